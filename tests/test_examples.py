"""The plain-PyTorch examples, launched as a user would (the Lightning ones: tests/lightning/test_examples.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.launcher.common import torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_generate_then_train_runs_on_two_cpu_processes_and_the_reward_climbs() -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    command = torchrun()
    done = subprocess.run(
        [*command, str(ROOT / "examples" / "generate_then_train.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"first ([\d.]+) -> last ([\d.]+)", done.stdout)
    assert found is not None, done.stdout
    first, last = float(found[1]), float(found[2])
    assert first < 0.2 and last > 2 * first, done.stdout  # from chance (1/16) upwards
