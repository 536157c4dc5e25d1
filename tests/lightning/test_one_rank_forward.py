"""A forward run on rank 0 only at stage 3 (a sample logged in ``on_validation_epoch_end`` during fit): rank 0
waits in a parameter gather on the shared-memory path while rank 1 goes on to Lightning's next collective (the
fit epoch's ``self.log(sync_dist=True)`` reduction, on gloo). Each used to wait for the other on a different transport
for the shared-memory timeout (30 minutes); the strategies' collectives now meet the gathers first, so both
ranks raise at once, naming what each was doing ([Note: meeting before a collective outside the model])."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV

pytestmark = pytest.mark.multiprocess


def _fit(rank: int, world_size: int, rank0_only: bool) -> dict[str, Any]:
    saved_env = dict(os.environ)
    try:
        import lightning.pytorch as pl
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        from ds_strategy.lightning import ZeroStrategy

        class Net(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
                self.log("train_loss", loss, sync_dist=True, on_epoch=True)
                return loss

            def validation_step(self, batch: Any, batch_idx: int) -> None:
                self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

            def on_validation_epoch_end(self) -> None:
                if self.global_rank == 0 or not rank0_only:
                    self.net(torch.ones(1, 8))  # a sample for the log

        pl.seed_everything(0, verbose=False)
        data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
        strategy = ZeroStrategy(stage=3, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world_size,
            max_epochs=2,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = DataLoader(data, batch_size=4)
        start = time.monotonic()
        try:
            trainer.fit(Net(), loader, loader)
        except RuntimeError as err:
            return {"error": str(err), "seconds": time.monotonic() - start}
        return {"val_loss": float(trainer.callback_metrics["val_loss"]), "error": None}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _run(rank0_only: bool) -> list[dict[str, Any]]:
    return run_distributed(_fit, 2, args=(rank0_only,), env=ELASTIC_ENV, init_process_group=False, timeout=120)


def test_a_forward_on_every_rank_in_an_epoch_hook_runs() -> None:
    for r in _run(rank0_only=False):
        assert r["error"] is None, r


def test_a_forward_on_one_rank_raises_at_once_on_every_rank() -> None:
    rank0, rank1 = _run(rank0_only=True)
    assert rank0["error"] and rank1["error"], (rank0, rank1)
    assert (
        "rank 0 gathers 'net.0'" in rank0["error"] and "rank 1 is about to reduce outside the model" in rank0["error"]
    )
    assert rank1["error"].startswith("ZeRO-3: ranks diverged before a collective outside the model (this is rank 1")
    assert "rank 0 gathers 'net.0'" in rank1["error"], rank1["error"]
    assert max(rank0["seconds"], rank1["seconds"]) < 30, (rank0, rank1)
