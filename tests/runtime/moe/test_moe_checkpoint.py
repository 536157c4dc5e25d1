"""MoE checkpoints: experts in their own files, loaded at another ep_size, world size and stage, and
consolidated by ``ds-zero-to-fp32`` into the single-process model holding every expert.

Run A trains 2 steps (world 2, ep_size 2, stage 2) and saves; run B, at another layout, loads and trains a
third step on the same global batch (4 rows). Both are compared with one process holding every expert
that trains 3 steps (each rank's chunk gated on its own). Tolerances (fp32): rtol 2e-5 / atol 2e-6.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ds_strategy
from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict
from tests.harness import run_distributed
from tests.runtime.moe.common import data, full_model, local_model, local_view, reference_run

ROWS = 4  # global batch of every step
LR = 1e-2
CLIP = 0.05
TOL = {"rtol": 2e-5, "atol": 2e-6}


def _config(stage: int, world: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": ROWS // world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "gradient_clipping": CLIP,
    }


def _train(engine: Any, batches: list[Any], rank: int, world: int) -> list[float]:
    losses = []
    for x, y in batches:
        loss, _, _ = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def _save_body(rank: int, world: int, path: str, ep_size: int, stage: int) -> list[float]:
    model = local_model(full_model(), ep_size, rank % ep_size)
    engine, *_ = ds_strategy.initialize(model=model, config=_config(stage, world))
    losses = _train(engine, data(3, ROWS)[:2], rank, world)
    engine.save_checkpoint(path, tag="two")
    engine.destroy()
    return losses


def _load_body(rank: int, world: int, path: str, ep_size: int, stage: int, first_world: int) -> float:
    ep_rank = rank % ep_size
    model = local_model(full_model(seed=99), ep_size, ep_rank)  # other weights: the load must replace them
    engine, *_ = ds_strategy.initialize(model=model, config=_config(stage, world))
    engine.load_checkpoint(path, tag="two")
    full = full_model()
    ref = reference_run(full, data(3, ROWS), [first_world, first_world, world], LR, CLIP)
    loss = _train(engine, data(3, ROWS)[2:], rank, world)[0]
    assert loss == pytest.approx(ref["losses"][2], rel=TOL["rtol"], abs=TOL["atol"])
    got = engine.module.state_dict()
    for name, value in local_view(ref["state"], ep_size, ep_rank).items():
        torch.testing.assert_close(got[name].float(), value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    engine.destroy()
    return loss


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "ep_size", "stage"),
    [(2, 1, 1), (4, 4, 2), (4, 2, 0), (1, 1, 2)],
    ids=["w2-ep1-z1", "w4-ep4-z2", "w4-ep2-z0", "w1-ep1-z2"],
)
def test_moe_checkpoint_reshards(tmp_path: Path, world: int, ep_size: int, stage: int) -> None:
    losses = run_distributed(_save_body, world_size=2, args=(str(tmp_path), 2, 2), timeout=240)
    ref = reference_run(full_model(), data(3, ROWS), 2, LR, CLIP)
    assert losses[0] == pytest.approx(ref["losses"][:2], rel=TOL["rtol"], abs=TOL["atol"])
    files = sorted(p.name for p in (tmp_path / "two").glob("expert_*"))
    assert files == [f"expert_000_{e:05d}_states.pt" for e in range(4)]  # one file per expert
    run_distributed(_load_body, world_size=world, args=(str(tmp_path), ep_size, stage, 2), timeout=240)


@pytest.mark.multiprocess
def test_zero_to_fp32_consolidates_every_expert(tmp_path: Path) -> None:
    run_distributed(_save_body, world_size=2, args=(str(tmp_path), 2, 1), timeout=240)
    ref = reference_run(full_model(), data(3, ROWS)[:2], 2, LR, CLIP)
    state = consolidate_fp32_state_dict(tmp_path, "two")
    assert list(state) == list(ref["state"])  # the single-process model's keys, in its order
    for name, value in ref["state"].items():
        torch.testing.assert_close(state[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    out = tmp_path / "fp32.pt"
    cli = [sys.executable, "-m", "ds_strategy.runtime.checkpoint.consolidate", str(tmp_path), str(out), "--tag", "two"]
    subprocess.run(cli, check=True, capture_output=True)
    model = full_model(seed=5)
    model.load_state_dict(torch.load(out, weights_only=True))  # the model holding every expert takes it
    torch.testing.assert_close(model.state_dict(), ref["state"], **TOL)


def _entries_save(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    from tests.runtime.test_full_values import batches, full_model, local_model

    model = local_model(full_model(moe=True), 2, rank % 2)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 40, "allgather_bucket_size": 40},
    }
    engine, *_ = ds_strategy.initialize(model=model, config=config)
    x, y = batches(world)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()
    engine.save_checkpoint(path, tag="entries")
    whole = engine.full_state_dict(rank=None)
    engine.destroy()
    return whole


def _entries_load(rank: int, world: int, path: str, ep_size: int, stage: int) -> dict[str, torch.Tensor]:
    from tests.runtime.test_full_values import Net

    torch.manual_seed(11)  # other weights, and every expert's shift and scale at their defaults
    engine, *_ = ds_strategy.initialize(
        model=Net(ep_size),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}},
    )
    engine.load_checkpoint(path, tag="entries", load_optimizer_states=False)
    whole = engine.full_state_dict(rank=None)
    engine.destroy()
    return whole


@pytest.mark.multiprocess
@pytest.mark.slow
def test_expert_buffers_and_frozen_expert_parameters_reshard(tmp_path: Path) -> None:
    """Each expert's own buffer and frozen parameter (tests/runtime/test_full_values.py's expert) are saved in
    its expert file and come back to whichever rank holds that expert: saved at 4 ranks (ep_size 2, each
    expert on 2 ranks, stage 1), loaded at 2 ranks with ep_size 2 (stage 2) and with ep_size 1 (every
    expert on every rank, stage 0); the whole state dict is the saved one, exactly."""
    saved = run_distributed(_entries_save, world_size=4, args=(str(tmp_path),), timeout=240)[0]
    assert any(k.endswith(".3.scale") for k in saved) and any(k.endswith(".3.shift") for k in saved)
    for ep_size, stage in ((2, 2), (1, 0)):
        for rank, got in enumerate(
            run_distributed(_entries_load, world_size=2, args=(str(tmp_path), ep_size, stage), timeout=240)
        ):
            assert got.keys() == saved.keys()
            for name, value in saved.items():
                assert torch.equal(got[name], value), f"{name} on rank {rank} (ep_size {ep_size}, stage {stage})"
