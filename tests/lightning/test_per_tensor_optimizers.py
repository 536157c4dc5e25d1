"""A per-tensor optimizer through the Trainer (issue 46, criterion 2): ``configure_optimizers`` returns
``MuonWithAuxAdam`` (Muon on the Llama's weight matrices, AdamW on embeddings and norms) and
``ZeroStrategy(stage=3)`` trains a Hugging Face Llama from a config like one process running the same
optimizer on the same global batches: 2 ranks, fp32, 3 steps; weights within 2e-5 (the reference sums the
ranks' gradients in another order; Muon's Newton-Schulz runs in bf16 on both sides).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, quiet_trainer
from tests.sequence.common import tiny_causal_lm

STEPS, MICRO, SEQ = 3, 2, 12
KW: dict[str, Any] = {"env": ELASTIC_ENV, "init_process_group": False, "timeout": 300}


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, 128, (STEPS * MICRO * 2, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    from ds_strategy import MuonWithAuxAdam
    from ds_strategy.runtime.muon import embedding_ids, split_for_muon

    groups = split_for_muon([{"params": list(model.parameters())}], embedding_ids(model))
    return MuonWithAuxAdam(groups, lr=0.02, adam_lr=3e-3, weight_decay=0.01)


def _reference(world: int) -> dict[str, torch.Tensor]:
    model = tiny_causal_lm("Llama", "sdpa")
    optimizer = _optimizer(model)
    loaders = [
        DataLoader(Tokens(), batch_size=MICRO, sampler=DistributedSampler(Tokens(), world, r, shuffle=True, seed=0))
        for r in range(world)
    ]
    for batches in zip(*loaders, strict=True):
        loss = sum(model(**b).loss for b in batches) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainer_body(rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    from ds_strategy.lightning import ZeroStrategy

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_causal_lm("Llama", "sdpa")

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.model)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Tokens(), batch_size=MICRO)

    class Capture(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            full = trainer.strategy.engine.full_state_dict(rank=None)  # type: ignore[attr-defined]
            pl_module.full = {k.removeprefix("model."): v for k, v in full.items()}  # type: ignore[assignment]
            pl_module.whole = trainer.strategy.engine.stage.whole is not None  # type: ignore[attr-defined]

    lit = Lit()
    trainer = quiet_trainer(ZeroStrategy(stage=3), world, STEPS, [Capture()])
    trainer.fit(lit)
    want = _reference(world)
    got = lit.full  # type: ignore[attr-defined]
    assert got.keys() == want.keys()
    diffs = {name: (got[name].float() - value).abs().max().item() for name, value in want.items()}
    return {"diffs": diffs, "whole": lit.whole}  # type: ignore[attr-defined]


def test_the_trainer_steps_muon_with_aux_adam_whole_like_one_process() -> None:
    for out in run_distributed(_trainer_body, world_size=2, **KW):
        assert out["whole"]
        worst = max(out["diffs"], key=out["diffs"].get)
        assert out["diffs"][worst] <= 2e-5, (worst, out["diffs"][worst])
