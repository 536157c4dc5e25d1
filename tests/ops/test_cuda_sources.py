"""CUDA sources cannot rot on CPU-only CI: compile every .cu with nvcc for sm_80 and sm_90, and
syntax-check every *_cuda.cpp op registration against torch's CUDA headers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from ds_strategy.ops.builder import csrc_root

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
CU_SOURCES = sorted(csrc_root().rglob("*.cu"))
CUDA_CPP_SOURCES = sorted(csrc_root().rglob("*_cuda.cpp"))


def _includes() -> list[str]:
    return [f"-I{p}" for p in (*include_paths(), str(csrc_root()))]


def _cuda_include_dir() -> Path:
    # Ask nvcc itself: it may be a wrapper script outside the toolkit (as /usr/local/bin/nvcc is here).
    assert NVCC is not None
    out = subprocess.run([NVCC, "--dryrun", "-E", "-x", "cu", "/dev/null"], capture_output=True, text=True, check=False)
    for token in (out.stdout + out.stderr).split():
        if token.startswith("-I") and Path(token[2:].strip('"'), "cuda_runtime.h").exists():
            return Path(token[2:].strip('"'))
    return Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")


def test_there_is_cuda_code_to_check() -> None:
    assert CU_SOURCES and CUDA_CPP_SOURCES


def _cmake_macros_stub(tmp_path: Path) -> Path:
    """The CPU wheel ships c10/cuda headers but not the CMake-generated macro header they include."""
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return tmp_path / "stub"


@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: p.name)
def test_cu_compiles_for_sm80_and_sm90(source: Path, tmp_path: Path) -> None:
    # The launchers check their launches with c10's C10_CUDA_KERNEL_LAUNCH_CHECK (c10/cuda headers).
    cmd = [
        str(NVCC), "-c", "-std=c++17", "-O2",
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        f"-I{_cmake_macros_stub(tmp_path)}", *_includes(), str(source), "-o", str(tmp_path / "out.o"),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("source", CUDA_CPP_SOURCES, ids=lambda p: p.name)
def test_cuda_op_registration_compiles(source: Path, tmp_path: Path) -> None:
    cxx = shutil.which("c++") or "g++"
    stub = _cmake_macros_stub(tmp_path)
    cmd = [cxx, "-std=c++20", "-fsyntax-only", f"-I{stub}", *_includes(), f"-I{_cuda_include_dir()}", str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
