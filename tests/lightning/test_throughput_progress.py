"""Tokens/s and MFU in Lightning's progress bar (issue 23, criterion 2): a 1-process fit with the
flops_profiler block on and a peak set; the strategy installs the ThroughputProgress callback."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV

pytestmark = pytest.mark.multiprocess

VOCAB, D, SEQ, BATCH = 16, 8, 5, 2


def _fit(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from ds_strategy.lightning import ZeroStrategy
    from ds_strategy.lightning.throughput import ThroughputProgress
    from ds_strategy.profiling import set_peak_tflops

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            logits = self.head(self.emb(batch))
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Probe(pl.Callback):
        engine: Any = None

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.engine = trainer.strategy.engine  # the strategy drops it at teardown

    saved = dict(os.environ)
    set_peak_tflops(1.0)
    try:
        data = DataLoader(list(torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(0))), BATCH)
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{tmp}/profile.txt"},
        }
        trainer = pl.Trainer(
            strategy=ZeroStrategy(stage=2, config=config),
            accelerator="cpu",
            devices=1,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            callbacks=[probe := Probe()],
        )
        model = LM()
        trainer.fit(model, data)
        return {
            "bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
            "callbacks": sum(isinstance(c, ThroughputProgress) for c in trainer.callbacks),
            "flops_per_sample": probe.engine.profiling.flops_per_sample,
            "throughput": probe.engine.throughput,
        }
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_progress_bar_shows_tokens_per_second_and_mfu(tmp_path: Any) -> None:
    (got,) = run_distributed(_fit, 1, args=(str(tmp_path),), env=ELASTIC_ENV, init_process_group=False, timeout=120)
    assert got["callbacks"] == 1
    assert {"tokens/s", "mfu"} <= set(got["bar"])
    rates = got["throughput"]
    assert got["bar"]["tokens/s"] == pytest.approx(rates["tokens_per_sec"], rel=1e-6)
    assert got["bar"]["mfu"] == pytest.approx(rates["mfu"], rel=1e-6)
    assert got["flops_per_sample"] == pytest.approx(3 * 2 * SEQ * D * VOCAB)  # fwd x 3 per sample
    assert "Flops profile at step 1" in (tmp_path / "profile.txt").read_text()
