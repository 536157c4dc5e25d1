"""LightningCLI with ds_strategy: the strategy comes from YAML, by name or as a class with a ds_config.

    python examples/cli.py fit --config examples/cli_zero2.yaml
    python examples/cli.py fit --config examples/cli_zero_config.yaml
    python examples/cli.py fit --config examples/cli_zero2.yaml --print_config

Run from the repository root (the YAML names examples/ds_config.json relative to it). As a script,
Lightning starts one process per device by re-running this command with the rank in the environment.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy.lightning  # noqa: F401  - registers zero0 ... zero3_offload (``import ds_strategy`` will too)


class RegressionModule(pl.LightningModule):
    """A small MLP fitting a noisy linear map."""

    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 4, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_out))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x).float(), y.float()), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        print(
            f"rank {self.global_rank}/{self.trainer.world_size}: {self.trainer.global_step} steps with "
            f"{type(strategy).__name__}(stage={getattr(strategy, 'stage', None)})",
            flush=True,
        )


class RegressionData(pl.LightningDataModule):
    def __init__(self, rows: int = 256, batch_size: int = 8, d_in: int = 16, d_out: int = 4, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, d_in, generator=g)
        y = x @ torch.randn(d_in, d_out, generator=g) + 0.1 * torch.randn(rows, d_out, generator=g)
        split = rows * 3 // 4
        self.train, self.val = TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val, batch_size=self.batch_size)


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return LightningCLI(RegressionModule, RegressionData, args=args, run=run, save_config_callback=None)


if __name__ == "__main__":
    main()
