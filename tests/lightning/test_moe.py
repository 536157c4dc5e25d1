"""Mixture of experts through Lightning: ``Trainer(strategy=ZeroStrategy(...))`` on 2 processes, each holding
half the experts (``ep_size=2``), trains as the single process holding every expert does.

The model, data and reference are those of tests/runtime/moe (the engine's own test): the same config
(AdamW and clipping from its blocks), each rank fed its chunk of the global batch. Tolerances as there
(fp32, 3 steps): rtol 2e-5 / atol 2e-6.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from tests.harness import run_distributed
from tests.runtime.moe.common import data, full_model, local_model, local_view, reference_run
from tests.runtime.moe.test_moe_engine import CLIP, LR, MICRO, STEPS, TOL, _config

EP_SIZE = 2


class LitMoE(pl.LightningModule):
    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        self.net = local_model(full_model(), EP_SIZE, ep_rank)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self.net(*batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> None:
        return None  # the config's optimizer block: it splits dense and expert parameters itself


def _fit(rank: int, world: int, stage: int) -> dict[str, Any]:
    import ds_strategy.lightning as zl

    saved_env = dict(os.environ)  # Lightning sets PL_GLOBAL_SEED etc.; the pooled worker outlives this run
    try:
        batches = data(STEPS, MICRO * world)
        mine = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]
        model = LitMoE(rank % EP_SIZE)
        trainer = pl.Trainer(
            strategy=zl.ZeroStrategy(stage=stage, config=_config(stage)),  # type: ignore[arg-type]
            accelerator="cpu",
            devices=world,
            max_steps=STEPS,
            use_distributed_sampler=False,  # each rank's own chunks, as the reference splits them
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(mine, batch_size=None))
        ref = reference_run(full_model(), batches, world, LR, CLIP)
        want = local_view(ref["state"], EP_SIZE, rank % EP_SIZE)
        got = {k: v.detach().float() for k, v in model.net.state_dict().items()}
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        return {"losses": model.losses, "reference": ref["losses"]}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_expert_parallel_under_lightning_matches_single_process(stage: int) -> None:
    results = run_distributed(_fit, world_size=2, args=(stage,), timeout=240)
    means = [sum(r["losses"][s] for r in results) / len(results) for s in range(STEPS)]
    assert means == pytest.approx(results[0]["reference"], rel=TOL["rtol"], abs=TOL["atol"])
