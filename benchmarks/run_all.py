"""Run every ``benchmarks/bench_*.py`` in one process tree, one after another (``nox -s bench``).

Each benchmark module exposes ``main(argv: list[str] | None) -> None`` and writes its JSON, markdown table
and PNG under benchmarks/results/.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = {a for a in argv if not a.startswith("-")}
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("bench_"))
    for name in names:
        if only and name not in only and name.removeprefix("bench_") not in only:
            continue
        start = time.monotonic()
        print(f"=== {name} ===", flush=True)
        importlib.import_module(f"benchmarks.{name}").main([a for a in argv if a.startswith("-")])
        print(f"=== {name}: {time.monotonic() - start:.0f}s ===", flush=True)


if __name__ == "__main__":
    main()
