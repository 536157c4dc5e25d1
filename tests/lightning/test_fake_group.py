"""``Trainer(strategy="zero3")`` in one process under torch's fake process group of 4 (issue 41, criterion 4).

The user initialises the fake group before fit; Lightning runs one process (``devices=1``) and the
strategy takes the group's rank and size for ZeRO, the sampler and Lightning's own bookkeeping ([Note: one
process for N ranks] in src/ds_strategy/lightning/process.py). Runs in the pytest process (no workers): the
group is destroyed and Lightning's rank_zero_only rank put back at the end of each test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.fake_pg import fake_group

WORLD = 4
D = 320  # a Linear(D, D) has more parameters than stage 3's default persistence threshold (1e5): partitioned
ROWS, BATCH, STEPS = 64, 4, 4


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(ROWS, D, generator=g)
        self.y = torch.randn(ROWS, 4, generator=g)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        loss = F.mse_loss(self.head(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Rows(), batch_size=BATCH, shuffle=True)


class Probe(Callback):
    """What the engine, the sampler and the comms logger saw during fit (the engine is gone after it)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.per_step: list[Counter[str]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        sampler = trainer.train_dataloader.sampler  # type: ignore[union-attr]
        self.seen = {
            "engine": (engine.dp_world_size, engine.dp_rank),
            "fake": (engine.coll.is_fake, engine.coll.has_peers, engine.coll.fast_path),
            "train_batch_size": engine.config.train_batch_size,
            "lightning": (trainer.world_size, trainer.global_rank, trainer.num_devices),
            "rank_zero": rank_zero_only.rank,  # type: ignore[attr-defined]
            "sampler": (type(sampler), getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)),
            "batches": len(trainer.train_dataloader),  # type: ignore[arg-type]
            "memory": engine.memory_breakdown(),
        }

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        logger = trainer.strategy.engine.comms_logger  # type: ignore[attr-defined]
        if logger is not None:
            logger.reset()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        logger = trainer.strategy.engine.comms_logger  # type: ignore[attr-defined]
        if logger is not None:
            self.per_step.append(Counter({f"{s.op}/{s.path}": s.count for s in logger.summary()}))


def _fit(monkeypatch: pytest.MonkeyPatch, strategy: Any, rank: int) -> tuple[pl.Trainer, Probe]:
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # the strategy sets it to the group's rank
    probe = Probe()
    with fake_group(monkeypatch, world_size=WORLD, rank=rank):
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1,
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[probe],
        )
        trainer.fit(Blocks())
    return trainer, probe


@pytest.mark.parametrize("rank", [0, WORLD - 1], ids=["rank0", "rank3"])
def test_zero3_fits_as_one_rank_of_a_fake_group(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    trainer, probe = _fit(monkeypatch, "zero3", rank)
    seen = probe.seen
    assert trainer.global_step == STEPS
    assert seen["engine"] == (WORLD, rank)
    assert seen["fake"] == (True, False, None)
    assert seen["lightning"] == (WORLD, rank, 1)
    assert seen["rank_zero"] == rank
    # The sampler hands this process rank r's quarter of the data, and the engine counts the global batch.
    assert seen["sampler"] == (DistributedSampler, WORLD, rank)
    assert seen["batches"] == ROWS // WORLD // BATCH
    assert seen["train_batch_size"] == BATCH * WORLD
    # Stage 3 at rest: a quarter of the fp32 weights on this rank (plus bucket padding and the parameters
    # small enough to stay whole on every rank: the head here).
    whole = sum(p.numel() for p in Blocks().parameters()) * 4
    assert whole / WORLD <= seen["memory"]["params"] <= 1.05 * whole / WORLD, (seen["memory"], whole)


def test_zero3_collectives_per_step_under_a_fake_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.lightning import ZeroStrategy

    strategy = ZeroStrategy(stage=3, config={"comms_logger": {"enabled": True}})
    trainer, probe = _fit(monkeypatch, strategy, 0)
    per_step = probe.per_step
    print(f"\nTrainer zero3 under a fake group of {WORLD}: collectives per step {[dict(c) for c in per_step]}")
    assert trainer.global_step == STEPS and len(per_step) == STEPS
    assert all(sum(c.values()) > 0 for c in per_step), per_step
    assert all(key.endswith("/fake") for c in per_step for key in c), per_step
    assert all(c == per_step[1] for c in per_step[1:]), f"the collectives differ from step to step: {per_step}"
    assert per_step[1]["all_gather/fake"] > 0 and per_step[1]["reduce_scatter/fake"] > 0, per_step


def test_a_fake_group_needs_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.lightning.process import fake_ranks

    assert fake_ranks(2) is None  # no group: nothing to adopt
    with fake_group(monkeypatch, world_size=WORLD, rank=2):
        assert fake_ranks(1) == (2, WORLD)
        with pytest.raises(ValueError, match="use devices=1"):
            fake_ranks(2)
