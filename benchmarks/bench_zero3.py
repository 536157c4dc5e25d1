"""Alias kept for existing commands (docs/zero3.md, ``--paired N``): the stage-3 cases of the end-to-end
benchmark (torch DDP, torch FSDP2, ds_strategy stage 2 / 3 / 3 + offload, DeepSpeed stage 3 / 3 + offload)
written to benchmarks/results/zero3.* by default; everything else is benchmarks/bench_e2e.py.

    python -m benchmarks.bench_zero3 [--quick] [--only "case,case"] [--name NAME] [--paired N]
"""

from __future__ import annotations

import importlib.util

from benchmarks import bench_e2e

STAGE3_CASES = [
    "torch DDP",
    "torch FSDP2",
    "ds_strategy stage 2",
    "ds_strategy stage 3",
    "ds_strategy stage 3 + offload",
]


def main(argv: list[str] | None = None) -> None:
    import sys

    cases = STAGE3_CASES + (
        ["deepspeed stage 3", "deepspeed stage 3 + offload"] if importlib.util.find_spec("deepspeed") else []
    )
    # argparse keeps the last occurrence of an option: the caller's --name / --only win over these defaults.
    bench_e2e.main(["--name", "zero3", "--only", ",".join(cases), *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
