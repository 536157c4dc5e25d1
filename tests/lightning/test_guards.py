"""Lightning guards (issue 18): the engine's counters under accumulate_grad_batches, the config's scheduler
on a skipped fp16 step, and GatheredParameters over plain parameters leaving no shared memory behind."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.harness import run_distributed

from .common import ELASTIC_ENV, fit_run

pytestmark = pytest.mark.multiprocess


def test_micro_steps_and_last_loss_under_accumulate_grad_batches() -> None:
    ranks = run_distributed(
        fit_run,
        world_size=2,
        args=("zero2", {"accumulate_grad_batches": 2, "max_epochs": 1}, {}),
        env=ELASTIC_ENV,
        timeout=180,
    )
    for r in ranks:
        batches = len(r["losses"])
        assert batches % 2 == 0 and batches >= 4
        assert r["engine"]["micro_steps"] == batches  # every micro-batch counted, not every optimizer step
        assert r["engine"]["global_steps"] == batches // 2
        # last_loss: the mean of the last window's micro-batch losses, in training_step's units.
        mean_last = sum(r["losses"][-2:]) / 2
        assert abs(r["engine"]["last_loss"] - mean_last) < 1e-6 * max(1.0, abs(mean_last)), r["engine"]


def _overflowing_fp16_strategy() -> Any:
    import ds_strategy.lightning as zl

    return zl.ZeroStrategy(
        stage=2,
        config={
            # A loss scale of 2**20 overflows fp16 gradients: the first steps are skipped while it halves.
            "fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1000, "hysteresis": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 100},
            },
        },
    )


def _scheduler_run(rank: int, world: int) -> dict[str, Any]:
    return fit_run(
        rank,
        world,
        _overflowing_fp16_strategy(),
        {"max_epochs": 3, "precision": "16-true"},
        {"return_optimizer": False},
    )


def test_config_scheduler_does_not_advance_on_a_skipped_fp16_step() -> None:
    ranks = run_distributed(_scheduler_run, world_size=2, env=ELASTIC_ENV, timeout=180)
    for r in ranks:
        info = r["engine"]
        assert info["skipped_steps"] > 0, info
        applied = info["global_steps"] - info["skipped_steps"]
        assert applied > 0
        # WarmupLR starts at iteration -1 and advances once per applied step only, as in DeepSpeed's engine
        # (Lightning alone would step it at every optimizer step: global_steps - 1).
        assert info["scheduler_iterations"] == [applied - 1], info


def _gathered_plain(rank: int, world: int) -> dict[str, Any]:
    import torch

    from ds_strategy.zero import GatheredParameters

    before = set(os.listdir("/dev/shm"))
    model = torch.nn.Linear(8, 8)
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            model.weight.data.fill_(1.5)
    after = set(os.listdir("/dev/shm"))
    return {"new": sorted(after - before), "weight": float(model.weight.data.mean())}


def test_gathered_parameters_over_plain_parameters_leaves_no_shared_memory() -> None:
    ranks = run_distributed(_gathered_plain, world_size=2, timeout=120)
    for r in ranks:
        assert r["new"] == [], f"left behind in /dev/shm: {r['new']}"
        assert r["weight"] == 1.5  # rank 0's edit reached every rank
