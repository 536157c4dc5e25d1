"""Worker-side start for ranks that mpirun or srun started: scheduler variables -> torch's, then the script.

    mpirun ... python -u -m ds_strategy.launcher.bootstrap [--no_local_rank] [--module] script.py args

The scheduler's variables (ds_strategy/scheduler_env.py: OpenMPI, MVAPICH, MPICH / Intel MPI, SLURM) are
translated into RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK; MASTER_ADDR comes
from the launcher (``-x`` / the environment), Azure ML's master node or, under SLURM, the first host of the
node list. The script then runs in
this process (``runpy``), so the rank the scheduler signals is the rank that trains.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Mapping, Sequence

from ds_strategy.scheduler_env import SchedulerEnvError, read_scheduler

from .cli import DEFAULT_MASTER_PORT

__all__ = ["SchedulerEnvError", "main", "rank_variables"]


def rank_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's env:// variables derived from whichever scheduler started this process
    (ds_strategy/scheduler_env.py: OpenMPI, MVAPICH, MPICH / Intel MPI, SLURM)."""
    found = read_scheduler(environ, srun_task=True, complete=True)
    if found is None:
        if "RANK" in environ and "WORLD_SIZE" in environ:
            return {}  # torchrun or a user already set them
        raise SchedulerEnvError(
            "no rank variables found: start this module with mpirun (OpenMPI / MPICH) or srun, "
            "or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
        )
    assert found.local_rank is not None and found.local_size is not None  # complete=True
    out = {
        "RANK": str(found.rank),
        "WORLD_SIZE": str(found.world_size),
        "LOCAL_RANK": str(found.local_rank),
        "LOCAL_SIZE": str(found.local_size),
        "LOCAL_WORLD_SIZE": str(found.local_size),
    }
    # The node index (torchelastic's GROUP_RANK; Lightning reads it when LOCAL_RANK is set): the scheduler's
    # when it has one, else RANK // LOCAL_SIZE (our mpirun lines fill hosts one after the other).
    node = found.node_rank if found.node_rank is not None else found.rank // max(found.local_size, 1)
    out["GROUP_RANK"] = str(node)
    if not environ.get("MASTER_ADDR"):
        if found.master_addr is None:
            raise SchedulerEnvError(
                f"{found.scheme.title} gave this process rank {found.rank} but MASTER_ADDR is not set: pass "
                "--master_addr to ds-launch or export MASTER_ADDR to every rank"
            )
        out["MASTER_ADDR"] = found.master_addr
    out["MASTER_PORT"] = environ.get("MASTER_PORT") or str(found.master_port or DEFAULT_MASTER_PORT)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_strategy.launcher.bootstrap", allow_abbrev=False)
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        os.environ.update(rank_variables(os.environ))
    except (SchedulerEnvError, ValueError) as exc:
        sys.exit(f"ds-launch bootstrap: {exc}")
    args = list(ns.user_args)
    if not ns.no_local_rank:
        args.append(f"--local_rank={os.environ['LOCAL_RANK']}")
    if ns.module:
        sys.argv = [ns.user_script, *args]
        runpy.run_module(ns.user_script, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [ns.user_script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.user_script)))
        runpy.run_path(ns.user_script, run_name="__main__")


if __name__ == "__main__":
    main()
