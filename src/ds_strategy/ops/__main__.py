"""``python -m ds_strategy.ops build``: compile every kernel library now instead of on first use."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ds_strategy.ops import builder
from ds_strategy.ops.isa import ISA_ENV, ISAS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_strategy.ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile the CPU (and, with CUDA, the CUDA) kernel libraries")
    build.add_argument("--isa", choices=ISAS, help=f"instruction set to compile for (default: detect; env {ISA_ENV})")
    build.add_argument("--verbose", action="store_true", help="show the compiler commands")
    sub.add_parser("path", help="print the cache directory")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(builder.cache_root())
        return 0
    if builder.compiler() is None:
        print(
            f"error: no C++ compiler found (CXX={os.environ.get('CXX', 'c++')}); install g++ or clang++",
            file=sys.stderr,
        )
        return 1
    specs = [builder.cpu_spec(args.isa)]
    if torch.version.cuda is not None and torch.cuda.is_available():
        specs.append(builder.cuda_spec())
    for spec in specs:
        start = time.monotonic()
        built = builder.build_library(spec, verbose=args.verbose)
        state = "built" if built.built_here else "cached"
        print(f"{spec.name} [{spec.isa}] {state} in {time.monotonic() - start:.1f}s: {built.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
