"""``python -m ds_strategy.ops build``: compile every kernel library now instead of on first use."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ds_strategy.ops import aio_libs, builder
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
    print(_aio_report(specs[0]))
    return 0


def _aio_report(spec: builder.LibrarySpec) -> str:
    """Which I/O backend NVMe offload's engine uses, of those the CPU library was compiled with."""
    compiled = aio_libs.compiled_backends(spec.cflags)
    if spec.key() == builder.cpu_spec().key() and builder.load_cpu_kernels():
        from ds_strategy.ops.aio import backend

        used = backend()  # what this machine's kernel accepts (a sandbox may refuse io_uring)
    else:
        used = f"{compiled[0]} (expected; this build is not the one loaded here)"
    line = f"aio I/O backend: {used} (compiled: {', '.join(compiled)})"
    if compiled == ["blocking"]:
        line += (
            "; no liburing/libaio headers and library were found, so each I/O thread has one request in "
            "flight: install liburing-dev or libaio-dev and rebuild"
        )
    return line


if __name__ == "__main__":
    raise SystemExit(main())
