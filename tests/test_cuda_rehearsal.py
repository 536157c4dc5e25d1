"""The CUDA suite (tests/cuda) rehearsed on this CPU: ``DS_STRATEGY_CUDA_REHEARSAL=1`` runs it under the
device-strict mode with gloo and ``accelerator="cpu"`` (see [Note: rehearsal on CPU] in
tests/cuda/common.py), so its references, helpers and fixtures keep working on CPU-only CI and the suite
cannot rot between GPU runs (as tests/ops/test_cuda_sources.py keeps the .cu files compiling)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: nox -s cuda runs the suite itself")
def test_the_cuda_suite_passes_its_cpu_rehearsal(cpu_kernels: bool) -> None:
    env = {
        **os.environ,
        "DS_STRATEGY_CUDA_REHEARSAL": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    # Everything but the CUDA kernels runs in the rehearsal: a suite that skipped its engine tests would pass.
    assert passed is not None and int(passed.group(1)) >= 35, tail
    assert "failed" not in proc.stdout.splitlines()[-1], tail
