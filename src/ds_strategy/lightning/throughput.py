"""The engine's tokens/s and MFU in Lightning's progress bar (docs/profiling.md)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

# engine.throughput key -> the name shown in the progress bar
SHOWN = {"tokens_per_sec": "tokens/s", "mfu": "mfu"}


class ThroughputProgress(Callback):
    """Logs the last optimizer step's tokens/s and MFU (a fraction) with ``prog_bar=True`` on rank 0.

    ``ZeroStrategy`` adds one to the Trainer's callbacks when fitting; a value appears once it is known
    (tokens: a training forward with an integer tensor input; MFU: ``flops_profiler.enabled`` after its
    ``profile_step``, and a device peak)."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        stats: dict[str, float] = getattr(engine, "throughput", None) or {}
        for key, name in SHOWN.items():
            if key in stats:
                pl_module.log(
                    name, stats[key], prog_bar=True, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1
                )
