"""A ZeRO++ run (qwZ + hpZ + qgZ on 4 ranks: hpZ groups of 2, qgZ two-level) saves, is SIGKILLed in the middle
of its next save, and resumes bit for bit (issue 42, criterion 5).

The killed job runs as 4 processes of its own (``DS_STRATEGY_CKPT_TEST_PAUSE`` announces each file of the second
save on stderr and sleeps before writing it; the test kills every rank when rank 0 announces its shard, as
tests/runtime/test_checkpoint_kill.py does for one process). Then:

- same data-parallel size (4): the run resumed from ``latest`` (the first tag: the second never landed) gives the
  losses and fp32 masters of the same run without the interruption, bit for bit - and that run's saving changed
  nothing (a run that never saves gives the same values);
- another size (2 ranks: hpZ's group would be the whole world, so only qwZ and qgZ act): the checkpoint loads
  resharded to exactly the saved masters, and the run resumed from the killed job's checkpoint equals, bit for
  bit, the run resumed from the uninterrupted job's checkpoint of the same step. Equality with the 4-rank run
  cannot be bitwise: the gradient sums run in another order and qwZ quantizes other blocks (each rank's shard
  is quantized in blocks of 256); its losses stay within 1e-2 (relative) of it.

Every run uses torch.distributed (``DS_STRATEGY_SHM=0``): a killed process leaves no shared-memory segment, and
the killed job and the harness take the same collective path.
"""

from __future__ import annotations

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
from tests.runtime.common import config, full_masters, make_tied, micro_slice, token_batches

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.kernels]

REPO = Path(__file__).resolve().parents[2]
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
STEPS, SPLIT, MICRO, ROWS = 4, 2, 2, 8  # optimizer steps, the step saved before the kill, rows per step
NO_SHM = {"DS_STRATEGY_SHM": "0"}


def build(world: int) -> Any:
    """Stage 3 with qwZ + hpZ + qgZ; the global batch is ``ROWS`` rows at every world size."""
    import ds_strategy

    model = make_tied()
    cfg = config(stage=3, bucket=300, micro=MICRO, gas=ROWS // (MICRO * world))
    cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, **ZEROPP})
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(engine: Any, start: int, stop: int) -> list[float]:
    """Optimizer steps ``start``..``stop - 1`` of the data; the global mean loss of each."""
    world, rank, gas = engine.dp_world_size, engine.dp_rank, engine.gradient_accumulation_steps()
    losses = []
    for batch in token_batches(STEPS, ROWS, seed=1)[start:stop]:
        total = torch.zeros(())
        for m in range(gas):
            loss = engine(*micro_slice(batch, MICRO, world, m, rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (gas * world))
    return losses


SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
root, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as tests/harness.py: the same matmul sums
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, ".pg"), rank=rank, world_size=world)
from tests.runtime.test_zeropp_resume import SPLIT, STEPS, build, train
engine = build(world)
train(engine, 0, SPLIT)
engine.save_checkpoint(os.path.join(root, "ckpt"), tag="A")
os.environ["DS_STRATEGY_CKPT_TEST_PAUSE"] = "3"  # the kill lands within these 3 s
train(engine, SPLIT, STEPS)
engine.save_checkpoint(os.path.join(root, "ckpt"), tag="B")
print("finished", file=sys.stderr, flush=True)
"""
MARKER = "ds_strategy-ckpt-test: writing zero_rank_00000"  # rank 0's shard of tag B


def _killed_job(root: Path, world: int, timeout: float = 300) -> None:
    script = root / "job.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}",
        "DS_STRATEGY_LOG_LEVEL": "WARNING",
        **NO_SHM,
    }
    logs = [open(root / f"rank{r}.log", "w") for r in range(1, world)]  # noqa: SIM115 - closed below
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), str(r), str(world)],
            stderr=subprocess.PIPE if r == 0 else logs[r - 1],
            text=True,
            env=env,
            cwd=REPO,
        )
        for r in range(world)
    ]
    seen: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        assert procs[0].stderr is not None
        for line in procs[0].stderr:
            seen.append(line)
            if MARKER in line:
                for p in procs:
                    os.kill(p.pid, signal.SIGKILL)
                break
            if time.monotonic() > deadline:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    assert any(MARKER in line for line in seen), "never saw the second save start:\n" + "".join(seen[-40:])
    assert all(p.returncode == -signal.SIGKILL for p in procs), [p.returncode for p in procs]


def _uninterrupted(rank: int, world: int, root: str) -> dict[str, Any]:
    """The run without a kill (saving the same tag at the same step), and the same run saving nothing."""
    engine = build(world)
    never_saved = train(engine, 0, STEPS)
    never_saved_masters = full_masters(engine)
    engine.destroy()
    engine = build(world)
    losses = train(engine, 0, SPLIT)
    engine.save_checkpoint(root, tag="A")
    losses += train(engine, SPLIT, STEPS)
    out = {"losses": losses, "masters": full_masters(engine), "never_saved": never_saved}
    out["never_saved_masters"] = never_saved_masters
    engine.destroy()
    return out


def _resumed(rank: int, world: int, roots: list[str]) -> list[dict[str, Any]]:
    """Each checkpoint directory's ``latest`` loaded at this world size, then the rest of the run."""
    out = []
    for root in roots:
        engine = build(world)
        engine.load_checkpoint(root)
        loaded = full_masters(engine)
        step = engine.global_steps
        losses = train(engine, SPLIT, STEPS)
        out.append({"step": step, "loaded": loaded, "losses": losses, "masters": full_masters(engine)})
        engine.destroy()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_zeropp_run_killed_mid_save_resumes_bit_exactly(tmp_path: Path) -> None:
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

    killed, reference = tmp_path / "killed", tmp_path / "reference"
    killed.mkdir()
    _killed_job(killed, world=4)
    ckpt = killed / "ckpt"
    assert (ckpt / "latest").read_text() == "A"  # the second save never landed
    assert not (ckpt / "B").exists() and (ckpt / ".B.partial").is_dir()  # killed inside the save

    ref = run_distributed(_uninterrupted, world_size=4, args=(str(reference),), env=NO_SHM, timeout=300)[0]
    # Saving changes nothing: the run that saved equals the run that never did.
    assert ref["losses"] == ref["never_saved"]
    assert _same(ref["masters"], ref["never_saved_masters"])
    # The killed job's tag A holds what the uninterrupted job saved at the same step, bit for bit.
    saved = consolidate_fp32_state_dict(ckpt, "A")
    assert _same(saved, consolidate_fp32_state_dict(reference, "A"))

    # Same data-parallel size: the losses and masters of the uninterrupted run.
    for r in run_distributed(_resumed, world_size=4, args=([str(ckpt)],), env=NO_SHM, timeout=300):
        (resumed,) = r
        assert resumed["step"] == SPLIT
        assert resumed["losses"] == ref["losses"][SPLIT:], (resumed["losses"], ref["losses"])
        assert _same(resumed["masters"], ref["masters"])

    # Another size: loads resharded to the saved masters; resuming from the killed job's checkpoint or from the
    # uninterrupted one's gives the same run, bit for bit, close to the 4-rank one.
    for from_killed, from_reference in run_distributed(
        _resumed, world_size=2, args=([str(ckpt), str(reference)],), env=NO_SHM, timeout=300
    ):
        for resumed in (from_killed, from_reference):
            assert resumed["step"] == SPLIT
            loaded = resumed["loaded"]
            assert loaded and all(torch.equal(loaded[k], saved[k]) for k in loaded), sorted(loaded)
        assert from_killed["losses"] == from_reference["losses"]
        assert _same(from_killed["masters"], from_reference["masters"])
        torch.testing.assert_close(
            torch.tensor(from_killed["losses"]), torch.tensor(ref["losses"][SPLIT:]), rtol=1e-2, atol=0
        )
