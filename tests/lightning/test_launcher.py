"""The fork launcher when the parent already started torch's OpenMP pool (see launcher.py's Note)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fork_after_openmp_started_trains_single_threaded() -> None:
    # A fresh interpreter: the test process itself has long started its OpenMP pool.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["OMP_NUM_THREADS"] = "2"  # two threads per worker even on a 2-core machine: the case that would hang
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lightning.fork_after_openmp"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "FORK-AFTER-OPENMP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
