"""Nothing lost: a process SIGKILLed in the middle of a save leaves the previous checkpoint intact and
loadable, and ``latest`` naming a complete tag.

The save runs in a subprocess with the test-only hook ``DS_STRATEGY_CKPT_TEST_PAUSE`` (format.py), which
announces every file on stderr and sleeps before writing it; the test kills the process at a chosen
announcement. Three moments, run side by side: while the rank's shard is being written, after the new
tag was published but before ``latest`` was rewritten, and while a re-save of the *same* tag is between
its two renames (old copy moved aside, new one not yet in place).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys
import torch.distributed as dist
root, second_tag = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, ".pg"), rank=0, world_size=1)
from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict
from tests.runtime.common import batches, engine_run
from tests.runtime.test_checkpoint import COMBOS, make_engine
import torch
engine = make_engine(COMBOS[2])
data = batches(2, 4)
engine_run(engine, data[:1], micro=2, gas=2)
engine.save_checkpoint(root, tag="A")
torch.save(consolidate_fp32_state_dict(root, "A"), os.path.join(root, "reference.pt"))
os.environ["DS_STRATEGY_CKPT_TEST_PAUSE"] = "3"  # the kill lands within these 3 s
engine_run(engine, data[1:], micro=2, gas=2)
engine.save_checkpoint(root, tag=second_tag)
"""

MOMENTS = {  # name: (tag of the second save, announcement to kill at)
    "shard": ("B", "writing zero_rank_00000_optim_states.pt"),
    "latest": ("B", "writing latest"),
    "swap": ("A", "writing A (between renames)"),
}


def _start(root: Path, tag: str) -> subprocess.Popen[str]:
    root.mkdir()
    script = root.parent / f"{root.name}.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "DS_STRATEGY_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(
        [sys.executable, str(script), str(root), tag], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO
    )


def _kill_at(proc: subprocess.Popen[str], marker: str, timeout: float = 180) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"never saw {marker!r}; the process printed:\n{''.join(seen[-40:])}")


def _load_latest(rank: int, world: int, roots: list[str]) -> list[int]:
    from tests.runtime.test_checkpoint import COMBOS, make_engine

    steps = []
    for root in roots:
        engine = make_engine(COMBOS[2], seed=3)
        engine.load_checkpoint(root)
        steps.append(engine.global_steps)
        engine.destroy()
    return steps


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

    procs = {name: _start(tmp_path / name, tag) for name, (tag, _) in MOMENTS.items()}
    for name, (_, marker) in MOMENTS.items():
        _kill_at(procs[name], marker)
    for name in MOMENTS:
        root = tmp_path / name
        assert (root / "latest").read_text() == "A", name
        reference = torch.load(root / "reference.pt", weights_only=True)
        restored = consolidate_fp32_state_dict(root)
        assert restored.keys() == reference.keys(), name
        assert all(torch.equal(restored[k], reference[k]) for k in reference), name
    roots = [str(tmp_path / name) for name in MOMENTS]
    assert run_distributed(_load_latest, world_size=1, args=(roots,)) == [[1, 1, 1]]
    # what each kill left behind: a staging directory (never loaded), a complete B, the old A set aside
    assert (tmp_path / "shard" / ".B.partial").is_dir() and not (tmp_path / "shard" / "B").exists()
    assert (tmp_path / "latest" / "B" / "meta.pt").is_file()
    assert not (tmp_path / "swap" / "A").exists() and (tmp_path / "swap" / ".A.replaced" / "meta.pt").is_file()
