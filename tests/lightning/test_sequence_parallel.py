"""Ulysses through the Lightning faces (issue 45, criterion 3): ``ZeroStrategy(sequence_parallel_size=2)`` in a
Trainer and ``ZeroFabricStrategy(sequence_parallel_size=2)`` in a Fabric loop train a Hugging Face Llama from
a config like one process (plain torch, ``attn_implementation="sdpa"``, whole sequences) on the same batches.

The Trainer shards each batch itself (``ZeroStrategy.batch_to_device``: a dict with ``input_ids``); its sampler
deals one replica per sequence-parallel group, so both ranks of the group see the same sequences. In Fabric
the loop calls ``shard_batch``. fp32, SGD (lr 0.5: a gradient off by a factor shows), 3 steps of 2 sequences
of 13 tokens; weights atol 3e-5 (tests/runtime/test_sequence_parallel.py says why).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV
from tests.sequence.common import tiny_causal_lm

STEPS, MICRO, SEQ, LR = 3, 2, 13, 0.5
KW: dict[str, Any] = {"env": ELASTIC_ENV, "init_process_group": False, "timeout": 300}


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 128, (STEPS * MICRO, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[2 + i % 3 : 5 + i % 3] = -100  # ignored targets, unevenly spread over the shards
        return {"input_ids": self.ids[i], "labels": labels}


def _model(attn: str) -> Any:
    import transformers  # noqa: F401  (register takes it from sys.modules)

    from ds_strategy.sequence import register

    register()
    return tiny_causal_lm("Llama", attn)


def _reference(shuffle: bool) -> dict[str, torch.Tensor]:
    model = _model("sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    # Lightning's sampler for a training loader: shuffled with seed 0, one replica (the sequence-parallel group).
    sampler = DistributedSampler(Tokens(), num_replicas=1, rank=0, shuffle=shuffle, seed=0)
    for batch in DataLoader(Tokens(), batch_size=MICRO, sampler=sampler):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name].float(), value, rtol=0.0, atol=3e-5, msg=lambda m, n=name: f"{n}: {m}")


def _trainer_body(rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    from ds_strategy.lightning import ZeroStrategy

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model("ds_ulysses")
            self.shapes: list[tuple[int, ...]] = []

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            self.shapes.append(tuple(batch["input_ids"].shape))
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Tokens(), batch_size=MICRO)

    class Capture(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            full = trainer.strategy.engine.full_state_dict(rank=None)  # type: ignore[attr-defined]
            pl_module.full = {k.removeprefix("model."): v for k, v in full.items()}  # type: ignore[assignment]

    lit = Lit()
    strategy = ZeroStrategy(stage=3, sequence_parallel_size=2)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        callbacks=[Capture()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    sampler = strategy.distributed_sampler_kwargs
    trainer.fit(lit)
    _assert_matches(lit.full, _reference(shuffle=True))  # type: ignore[arg-type]
    return {"sampler": sampler, "shapes": lit.shapes}


def test_the_trainer_shards_batches_and_trains_like_one_process() -> None:
    for out in run_distributed(_trainer_body, world_size=2, **KW):
        assert out["sampler"] == {"num_replicas": 1, "rank": 0}  # both ranks read the same sequences
        assert out["shapes"] == [(MICRO, 7)] * STEPS  # 13 tokens padded to 14, 7 per rank


def _fabric_body(rank: int, world: int) -> None:
    from lightning.fabric import Fabric

    from ds_strategy.lightning import ZeroFabricStrategy
    from ds_strategy.sequence import shard_batch

    fabric = Fabric(strategy=ZeroFabricStrategy(stage=2, sequence_parallel_size=2), accelerator="cpu", devices=world)
    fabric.launch()
    model = _model("ds_ulysses")
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(Tokens(), batch_size=MICRO))
    for batch in loader:
        fabric.backward(model(**shard_batch(batch)).loss)
        optimizer.step()
        optimizer.zero_grad()
    engine = fabric.strategy.engines[0]  # type: ignore[attr-defined]
    _assert_matches(engine.full_state_dict(rank=None), _reference(shuffle=False))


def test_fabric_trains_like_one_process() -> None:
    run_distributed(_fabric_body, world_size=2, **KW)
