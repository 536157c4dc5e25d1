"""``Trainer(sync_batchnorm=True)`` and other LayerSync plugins under ZeroStrategy: applied for fit and reverted
after it, as DDPStrategy does (they used to be ignored silently); torch's SyncBatchNorm on the CPU is refused
before anything is built (torch raises at the first training forward there, under DDP too)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from torch.utils.data import DataLoader

from tests.harness import run_distributed

from .common import ELASTIC_ENV, Regression

pytestmark = pytest.mark.multiprocess


class MarkedBatchNorm(nn.BatchNorm1d):
    """What the test plugin converts to: a BatchNorm the test can recognise."""


class MarkingSync(LayerSync):
    """A LayerSync that swaps each BatchNorm1d for a MarkedBatchNorm (keeping its parameters) and back."""

    def apply(self, model: nn.Module) -> nn.Module:
        return self._swap(model, nn.BatchNorm1d, MarkedBatchNorm)

    def revert(self, model: nn.Module) -> nn.Module:
        return self._swap(model, MarkedBatchNorm, nn.BatchNorm1d)

    @staticmethod
    def _swap(model: nn.Module, old: type[nn.Module], new: type[nn.BatchNorm1d]) -> nn.Module:
        for name, child in list(model.named_children()):
            if type(child) is old:
                assert isinstance(child, nn.BatchNorm1d)
                swapped = new(child.num_features)
                swapped.weight, swapped.bias = child.weight, child.bias
                swapped.running_mean, swapped.running_var = child.running_mean, child.running_var
                setattr(model, name, swapped)
            else:
                MarkingSync._swap(child, old, new)
        return model


class BatchNormNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
        self.norm_types: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.norm_types.append(type(self.net[1]).__name__)
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(), batch_size=8)


def _fit(rank: int, world: int, stage: int, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    from ds_strategy.lightning import ZeroStrategy

    pl.seed_everything(0, verbose=False)
    model = BatchNormNet()
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=stage),
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    try:
        trainer.fit(model)
    except Exception as e:  # the message is what the test checks
        return {"error": f"{type(e).__name__}: {e}"}
    return {"during": sorted(set(model.norm_types)), "after": type(model.net[1]).__name__}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_layer_sync_plugin_is_applied_for_fit_and_reverted_after(stage: int) -> None:
    ranks = run_distributed(
        _fit, world_size=2, args=(stage, {"plugins": [MarkingSync()]}), env=ELASTIC_ENV, timeout=180
    )
    for r in ranks:
        assert r == {"during": ["MarkedBatchNorm"], "after": "BatchNorm1d"}, r


def test_sync_batchnorm_on_the_cpu_is_refused_before_fit() -> None:
    ranks = run_distributed(_fit, world_size=2, args=(2, {"sync_batchnorm": True}), env=ELASTIC_ENV, timeout=180)
    for r in ranks:
        assert "sync_batchnorm=True" in r["error"] and "GPUs only" in r["error"], r
