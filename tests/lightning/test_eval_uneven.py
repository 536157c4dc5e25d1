"""``trainer.validate`` at stage 3 with an iterable dataset sharded by rank ([Note: uneven evaluation] in
src/ds_strategy/lightning/uneven_eval.py). Equal batch counts: the loss equals DDP's (fp32, 1e-6). Rank 0
with 3 batches, rank 1 with 2: DDP runs it, stage 3 cannot (every forward gathers with every rank), and it
must say so at once on the rank that ran out instead of waiting for the process group's 30 minutes."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV

pytestmark = pytest.mark.multiprocess


def _validate(rank: int, world_size: int, strategy: str, batches: tuple[int, int]) -> dict[str, Any]:
    saved_env = dict(os.environ)
    try:
        import lightning.pytorch as pl
        from torch import nn
        from torch.utils.data import DataLoader, IterableDataset

        import ds_strategy.lightning  # noqa: F401 - registers the names in this worker

        class Shard(IterableDataset):
            def __iter__(self) -> Any:
                g = torch.Generator().manual_seed(rank)
                for _ in range(batches[rank] * 4):
                    x = torch.randn(8, generator=g)
                    yield x, x.sum(0, keepdim=True)

        class Net(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))

            def validation_step(self, batch: Any, batch_idx: int) -> None:
                self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

        pl.seed_everything(0, verbose=False)
        if strategy == "zero3":  # every parameter partitioned: each forward gathers
            from ds_strategy.lightning import ZeroStrategy

            zero: Any = ZeroStrategy(stage=3, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
        else:
            zero = strategy
        trainer = pl.Trainer(
            strategy=zero, accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False
        )
        start = time.monotonic()
        try:
            (metrics,) = trainer.validate(Net(), DataLoader(Shard(), batch_size=4), verbose=False)
        except RuntimeError as err:
            return {"error": str(err), "seconds": time.monotonic() - start}
        return {"val_loss": float(metrics["val_loss"]), "error": None}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _run(strategy: str, batches: tuple[int, int]) -> list[dict[str, Any]]:
    return run_distributed(
        _validate, 2, args=(strategy, batches), env=ELASTIC_ENV, init_process_group=False, timeout=120
    )


def test_even_iterable_validation_matches_ddp() -> None:
    ref = _run("ddp", (2, 2))
    got = _run("zero3", (2, 2))
    for r, g in zip(ref, got, strict=True):
        assert g["error"] is None and g["val_loss"] == pytest.approx(r["val_loss"], rel=1e-6, abs=1e-7)


def test_uneven_iterable_validation_raises_at_once_on_every_rank() -> None:
    got = _run("zero3", (3, 2))
    assert "ran out at different points (rank 1 has no batch after 2" in got[1]["error"], got[1]
    assert "diverged" in got[0]["error"], got[0]  # rank 0, in its third forward, meets rank 1's closing label
    assert max(r["seconds"] for r in got) < 30, got
