"""The LightningModule of the demo: the small GPT with AdamW, one loss value per step on the progress bar."""

from __future__ import annotations

import math
from typing import Any

import torch

import lightning as L
from ds_strategy.demo.model import GPT, GPTConfig

WARMUP_STEPS = 10


def lr_factor(step: int, total_steps: int, warmup: int = WARMUP_STEPS, floor: float = 0.1) -> float:
    """Linear warm-up, then a cosine from 1 down to ``floor`` at ``total_steps`` (and ``floor`` after it)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """``schedule_steps``: the length of the learning-rate schedule. Runs of different lengths that share it
    take identical steps, so their losses can be compared step by step."""

    def __init__(self, cfg: GPTConfig, lr: float, schedule_steps: int) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.lr = lr
        self.schedule_steps = schedule_steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = self.model.loss(idx, targets)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, self.schedule_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
