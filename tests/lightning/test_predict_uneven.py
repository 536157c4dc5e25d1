"""``trainer.predict`` at stage 3 when the ranks hold different numbers of batches ([Note: uneven predict] in
src/ds_strategy/lightning/uneven_predict.py): Lightning does not pad predict data, so with 9 rows, batch 4
and 2 ranks rank 0 runs 2 batches and rank 1 one. Each stage-3 forward gathers with the other rank: rank 1
replays its last batch so that rank 0's second forward completes. Reference: the same predict under DDP;
every rank's predictions equal DDP's (fp32, 1e-6), and nothing waits for a rank that has finished."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV

pytestmark = pytest.mark.multiprocess


def _predict(rank: int, world_size: int, strategy: str, rows: int) -> dict[str, Any]:
    saved_env = dict(os.environ)
    try:
        import lightning.pytorch as pl
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        import ds_strategy.lightning  # noqa: F401 - registers the names in this worker

        class Net(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
                self.calls = 0

            def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                self.calls += 1
                return self.net(batch[0])

        pl.seed_everything(0, verbose=False)
        model = Net()
        data = torch.randn(rows, 8, generator=torch.Generator().manual_seed(1))
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False
        )
        out = trainer.predict(model, DataLoader(TensorDataset(data), batch_size=4))
        assert out is not None
        return {"predictions": [o.detach().clone() for o in out], "calls": model.calls}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _run(strategy: str, rows: int) -> list[dict[str, Any]]:
    return run_distributed(_predict, 2, args=(strategy, rows), env=ELASTIC_ENV, init_process_group=False)


def test_uneven_predict_batches_at_stage_3_match_ddp() -> None:
    ref = _run("ddp", 9)
    got = _run("zero3", 9)
    assert [len(r["predictions"]) for r in ref] == [2, 1]  # uneven: the case under test
    for rank, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert len(g["predictions"]) == len(r["predictions"]), rank
        for a, b in zip(g["predictions"], r["predictions"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert [g["calls"] for g in got] == [2, 2]  # rank 1 replayed its last batch once
