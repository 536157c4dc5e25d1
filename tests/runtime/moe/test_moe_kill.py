"""An MoE run saves, is SIGKILLed in the middle of its next save, and resumes bit-exactly (issue 42,
criterion 5, the MoE part).

The run (tests/runtime/moe/kill_script.py: 2 ranks, ``ep_size`` 2, stage 2, gradient clipping, AdamW, top-2
gating) trains 4 steps, saving tag ``A`` after step 2 and ``B`` after step 4. Once it runs to the end
(``clean``); once it is killed, every process of it at once, while rank 1 writes an expert file of ``B``
(``DS_STRATEGY_CKPT_TEST_PAUSE``, the main format's kill hook; the expert files are written through the
same staged, atomic path as the shards). Then:

- ``latest`` still names ``A``, ``B`` was never published, and ``A`` consolidates to exactly the ``A`` of the
  clean run;
- resumed from the killed run's ``latest`` at the same data-parallel size (2 ranks), steps 3-4 give the same
  losses as the uninterrupted run, bit for bit;
- resumed at another data-parallel size (4 ranks, ``ep_size`` 2: each expert now on 2 ranks), steps 3-4 give
  bit for bit the losses of the same resume from the clean run's ``A`` (the kill cost nothing), and match the
  single-process model (every expert, steps 1-2 gated as 2 ranks, 3-4 as 4) within the fp32 tolerance.
  The losses of another data-parallel size cannot equal the 2-rank run's bit for bit: the reductions add in
  another order and each rank gates its own share of the tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.runtime.moe.common import data, full_model, local_model, reference_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("kill_script.py")
ROWS, STEPS, SAVE_AT, EP = 4, 4, 2, 2
LR, CLIP = 1e-2, 0.05
TOL = {"rtol": 2e-5, "atol": 2e-6}
KW: dict[str, Any] = {"k": 2}
KILL_AT = "writing expert_000_00002_states.pt"  # rank 1's first expert file of B


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return data(STEPS, ROWS)


def config(world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "gradient_clipping": CLIP,
    }


def make_engine(rank: int, world: int, seed: int = 0) -> Any:
    import ds_strategy

    model = local_model(full_model(seed=seed, **KW), EP, rank % EP, **KW)
    engine, *_ = ds_strategy.initialize(model=model, config=config(world))
    return engine


def train(engine: Any, steps: list[Any], rank: int, world: int) -> list[float]:
    losses = []
    for x, y in steps:
        loss, _, _ = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _start(mode: str, root: Path, out: Path, pause: str | None = None) -> subprocess.Popen[str]:
    root.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "DS_STRATEGY_LOG_LEVEL": "WARNING"}
    env.pop("DS_STRATEGY_CKPT_TEST_PAUSE", None)
    if pause is not None:
        env["KILL_PAUSE"] = pause
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(root), str(out)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,  # its own process group: the kill takes every rank at once
    )


def _finish(proc: subprocess.Popen[str], what: str, timeout: float = 300) -> None:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, f"{what} failed:\n{err[-4000:]}"


def _kill_at(proc: subprocess.Popen[str], marker: str, timeout: float = 300) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        if time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"never saw {marker!r}; the run printed:\n{''.join(seen[-40:])}")


def _losses(path: Path) -> list[float]:
    return [float.fromhex(x) for x in json.loads(path.read_text())]


def _resume(rank: int, world: int, root: str) -> list[float]:
    engine = make_engine(rank, world, seed=9)  # other weights: the load must replace them
    engine.load_checkpoint(root, tag="A")
    losses = train(engine, batches()[SAVE_AT:], rank, world)
    engine.destroy()
    return losses


def test_moe_sigkill_mid_save_then_resume_bit_exactly(tmp_path: Path) -> None:
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

    clean, killed = tmp_path / "clean", tmp_path / "killed"
    runs = {
        "clean": _start("train", clean, tmp_path / "clean.json"),
        "killed": _start("train", killed, tmp_path / "x", "3"),
    }
    _kill_at(runs["killed"], KILL_AT)
    _finish(runs["clean"], "the uninterrupted run")
    assert (killed / "latest").read_text() == "A"
    assert not (killed / "B").exists() and (killed / ".B.partial").is_dir()
    want, got = consolidate_fp32_state_dict(clean, "A"), consolidate_fp32_state_dict(killed)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sum(".deepspeed_experts." in k for k in want) == 4 * 4  # every expert (4 entries each)

    # the same data-parallel size: the killed run's latest, resumed, continues as if nothing happened
    _finish(_start("resume", killed, tmp_path / "resumed.json"), "the resume at 2 ranks")
    uninterrupted = _losses(tmp_path / "clean.json")
    assert _losses(tmp_path / "resumed.json") == uninterrupted[SAVE_AT:]  # bit for bit

    # another data-parallel size: 4 ranks, each expert on 2 of them
    after_kill = run_distributed(_resume, world_size=4, args=(str(killed),), timeout=240)
    after_clean = run_distributed(_resume, world_size=4, args=(str(clean),), timeout=240)
    assert after_kill == after_clean  # bit for bit, every rank
    at_2 = reference_run(full_model(**KW), batches(), 2, LR, CLIP)["losses"]
    assert uninterrupted == pytest.approx(at_2, rel=TOL["rtol"], abs=TOL["atol"])
    then_4 = reference_run(full_model(**KW), batches(), [2, 2, 4, 4], LR, CLIP)["losses"]
    assert after_kill[0] == pytest.approx(then_4[SAVE_AT:], rel=TOL["rtol"], abs=TOL["atol"])
