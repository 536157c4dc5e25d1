"""``python -m ds_strategy.report``: what this environment can run, in the spirit of DeepSpeed's ds_report.

Versions of everything the kernels depend on, the accelerator and communication backend, every kernel
family with whether it can be built here, whether it is built, for which instruction set, the cache
directory, and what to do about anything missing.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from ds_strategy.ops import aio_libs, builder
from ds_strategy.ops.isa import detect_isa
from ds_strategy.table import print_table


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _tool_version(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return "not found"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"error: {err}"
    lines = [ln for ln in (out.stdout or out.stderr).splitlines() if ln.strip()]
    return lines[-1].strip() if cmd[0] == "nvcc" and lines else (lines[0].strip() if lines else "?")


def environment_rows() -> list[tuple[str, str]]:
    cxx = builder.compiler()
    cuda = torch.version.cuda
    accelerator = "cuda" if (cuda and torch.cuda.is_available()) else "cpu"
    return [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", f"{torch.__version__} (CUDA {cuda or 'none'})"),
        ("lightning", _version("lightning")),
        ("ds_strategy", _version("ds_strategy")),
        ("C++ compiler", f"{cxx}: {_tool_version([cxx, '--version'])}" if cxx else "not found (set CXX)"),
        ("ninja", _tool_version(["ninja", "--version"])),
        ("nvcc", _tool_version(["nvcc", "--version"])),
        ("accelerator", accelerator),
        ("comm backend", "nccl" if accelerator == "cuda" else "gloo (+ shared memory on one node)"),
        ("CPU instruction set", detect_isa()),
        ("async I/O libraries", _aio_libraries(cxx)),
        ("kernel cache", str(builder.cache_root())),
    ]


def _aio_libraries(cxx: str | None) -> str:
    """What the NVMe I/O engine is (or would be) built with; ``python -m ds_strategy.ops build`` says which
    one runs."""
    found = [f.library.backend for f in aio_libs.find(cxx)] if cxx else []
    return ", ".join(found) if found else "none found (blocking I/O only: install liburing-dev)"


def _families(root: Path) -> dict[str, list[str]]:
    """Kernel family (csrc subdirectory) -> op names it defines (from its TORCH_LIBRARY m.def strings)."""
    families: dict[str, list[str]] = {}
    for source in sorted(root.rglob("*.cpp")):
        ops = re.findall(r'm\.def\(\s*"([A-Za-z_0-9]+)\(', source.read_text(encoding="utf-8", errors="replace"))
        if ops:
            families.setdefault(source.parent.name, []).extend(ops)
    return families


def kernel_rows() -> tuple[list[tuple[str, ...]], list[str]]:
    hints: list[str] = []
    rows: list[tuple[str, ...]] = []
    cpu = builder.cpu_spec()
    cpu_built = builder.library_path(cpu).exists()
    compatible = builder.compiler() is not None
    seconds = ""
    if cpu_built:
        info = json.loads((builder.library_path(cpu).parent / "build_info.json").read_text(encoding="utf-8"))
        seconds = f" in {info['seconds']}s"
    for family, ops in _families(cpu.root).items():
        state = f"yes{seconds}" if cpu_built else "no (builds on first use)"
        rows.append((family, "cpu", ", ".join(ops), "yes" if compatible else "NO", state, cpu.isa))
    if not compatible:
        hints.append("Install g++ or clang++ (or set CXX): without one every kernel uses its pure-torch fallback.")
    elif not cpu_built:
        hints.append("Run `python -m ds_strategy.ops build` to compile the CPU kernels now instead of on first use.")
    cuda_sources = sorted({p.parent.name for p in cpu.root.rglob("*.cu")})
    cuda_ok = torch.version.cuda is not None and shutil.which("nvcc") is not None
    for family in cuda_sources:
        built = cuda_ok and torch.cuda.is_available() and builder.library_path(builder.cuda_spec()).exists()
        rows.append((family, "cuda", "(CUDA twin)", "yes" if cuda_ok else "no", "yes" if built else "no", "-"))
    if cuda_sources and not cuda_ok:
        hints.append(
            "CUDA kernels need a CUDA build of torch and nvcc; this torch is "
            f"{'CPU-only' if torch.version.cuda is None else 'CUDA ' + str(torch.version.cuda)}; "
            "see docs/installation.md."
        )
    return rows, hints


def main() -> None:
    print_table("ds_strategy environment", ("item", "value"), environment_rows())
    rows, hints = kernel_rows()
    print_table("kernels", ("family", "device", "ops", "compatible", "built", "ISA"), rows)
    for hint in hints:
        print(f"- {hint}")


if __name__ == "__main__":
    main()
