"""A torch-free worker for the launcher's process tests (starts in milliseconds).

--mode fail:      rank --fail_rank prints a marker to stderr and exits --code; the others wait (the launcher
                  must stop them).
--mode hang:      every rank starts a grandchild (``sleep``), writes ``rank<R>.pids`` (its pid and the
                  grandchild's) into --dir, then waits; the test signals the launcher and checks both are gone.
--mode record:    every rank writes its rank variables and argv to ``rank<R>.json`` in --dir.
--mode fail_once: rank 1 exits --code on the first attempt (the others wait); on the restart every rank writes
                  ``rank<R>.attempt<k>`` into --dir and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fail", "hang", "fail_once", "record"], required=True)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--fail_rank", type=int, default=1)
    parser.add_argument("--code", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(args.dir)
    if args.mode == "record":
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_TEST_USER_VAR")
        record = {
            "env": {k: os.environ.get(k) for k in keys},
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            # What torch.distributed.is_torchelastic_launched() reads, and so Lightning's TorchElasticEnvironment.
            "torchelastic": "TORCHELASTIC_RUN_ID" in os.environ,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    elif args.mode == "fail":
        (out / f"rank{rank}.pids").write_text(str(os.getpid()))
        if rank == args.fail_rank:
            time.sleep(0.5)  # let the other ranks start waiting
            print(f"rank {rank}: deliberate failure marker-7f3a", file=sys.stderr, flush=True)
            sys.exit(args.code)
        time.sleep(120)
    elif args.mode == "hang":
        child = subprocess.Popen(["sleep", "300"])
        tmp = out / f"rank{rank}.pids.tmp"
        tmp.write_text(f"{os.getpid()} {child.pid}")
        tmp.rename(out / f"rank{rank}.pids")  # atomic: the test never reads half a file
        time.sleep(300)
    else:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt == 0:
            if rank == 1:
                sys.exit(args.code)
            time.sleep(120)  # the launcher must stop this rank and restart both
        (out / f"rank{rank}.attempt{attempt}").write_text("ok")


if __name__ == "__main__":
    main()
