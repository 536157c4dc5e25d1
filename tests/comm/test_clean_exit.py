"""Every rank of a successful run exits 0, whatever the script does or omits at its end (issue 18).

Launches tests/comm/scripts/uneven_exit.py under torchrun with ranks that reach interpreter exit at
different times, over stages, precisions, offload, a checkpoint save, a Lightning fit, an MoE model and a
pipeline. A rank killed at exit (SIGABRT, "terminate called without an active exception") fails the
launch; so does a gloo thread alive after ds_strategy's exit handler (exit 3). CI runs a few launches;
DS_STRATEGY_EXIT_LAUNCHES=200 is the stress run quoted in docs/architecture.md. Two launches run at a
time (4 processes on this 2-core machine: shorter, and the exits meet more varied timing).
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launcher.common import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "uneven_exit.py"
# (KIND, STAGE, PREC, OFFLOAD): every kind once, the engine with and without offload; a stress run
# (DS_STRATEGY_EXIT_LAUNCHES above the count) adds the engine at stages 1 and 2, the rest of the cases.
CASES = [
    ("engine", 3, "bf16", "cpu"),
    ("engine", 0, "fp32", "none"),
    ("usergroup", 2, "fp32", "cpu"),
    ("selfdestroy", 1, "fp32", "none"),
    ("checkpoint", 3, "fp32", "none"),
    ("lightning", 3, "fp32", "none"),
    ("moe", 2, "fp32", "none"),
    ("pipeline", 1, "fp32", "none"),
]
STRESS_CASES = [("engine", 1, "bf16", "cpu"), ("engine", 2, "bf16", "none")]
LAUNCHES = int(os.environ.get("DS_STRATEGY_EXIT_LAUNCHES", str(len(CASES))))
if len(CASES) < LAUNCHES:  # the stress run: every case the issue names
    CASES += STRESS_CASES


def _launch(index: int, tmp_path: Path) -> tuple[int, str]:
    kind, stage, prec, offload = CASES[index % len(CASES)]
    env = {
        **os.environ,
        "KIND": kind,
        "STAGE": str(stage),
        "PREC": prec,
        "OFFLOAD": offload,
        "LATE": str((index // len(CASES)) % 2),
        "SECONDS_LATE": "1.0",
        "CKPT_DIR": str(tmp_path / f"ckpt{index}"),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [*torchrun(), str(SCRIPT)]  # two launches at a time: each on its own port
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    return proc.returncode, f"launch {index} {kind} stage {stage} {prec} offload={offload}:\n{proc.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_rank_exits_zero_when_ranks_finish_at_different_times(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda i: _launch(i, tmp_path), range(LAUNCHES)))
    failed = [f"rc={rc} {report}" for rc, report in results if rc != 0]
    assert not failed, f"{len(failed)} of {LAUNCHES} launches failed:\n" + "\n\n".join(failed)
