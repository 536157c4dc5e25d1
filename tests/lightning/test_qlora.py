"""QLoRA through the Trainer (issue 46, criterion 1): a LightningModule builds the 4-bit Llama (bitsandbytes nf4,
``bnb_4bit_quant_storage=torch.bfloat16``) with a peft LoRA adapter in ``configure_model`` and
``Trainer(strategy="zero3")`` / ``"zero2"`` trains it on 2 ranks like one process training the same 4-bit model
on both ranks' batches (tests/runtime/test_qlora.py's model, batches and reference; same tolerances: losses
rtol 1e-6, LoRA weights atol 1e-5). At stage 3 the packed base is partitioned while it trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, quiet_trainer
from tests.runtime.test_qlora import STEPS, _adapters, _batch, _qlora_model, _reference, _save_base

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

KW: dict[str, Any] = {"env": ELASTIC_ENV, "init_process_group": False, "timeout": 300}


class Batches(Dataset[dict[str, torch.Tensor]]):
    """This rank's batch of each step (test_qlora's ``_batch``): one item is a whole micro-batch."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        return _batch(step, self.rank)


def _body(rank: int, world: int, path: str, strategy: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    if rank == 0:
        _save_base(path)

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None

        def configure_model(self) -> None:
            if self.model is None:
                torch.distributed.barrier()  # rank 0 has written the base
                self.model = _qlora_model(path)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

        def train_dataloader(self) -> DataLoader[Any]:
            # each rank reads its own batches in order (no sampler): item i is step i's micro-batch
            return DataLoader(Batches(self.global_rank), batch_size=None, shuffle=False)

    class Capture(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            engine = trainer.strategy.engine  # type: ignore[attr-defined]
            full = {k.removeprefix("model."): v for k, v in engine.full_state_dict(rank=None).items()}
            pl_module.adapters = _adapters(full)  # type: ignore[assignment]
            pl_module.packed = [gs.rest.nbytes() for gs in getattr(engine.stage, "packed", [])]  # type: ignore[assignment]

    lit = Lit()
    lit.losses = []  # type: ignore[assignment]
    trainer = quiet_trainer(strategy, world, STEPS, [Capture()], use_distributed_sampler=False)
    trainer.fit(lit)
    losses = torch.stack(lit.losses)  # type: ignore[arg-type]
    torch.distributed.all_reduce(losses)
    return {"losses": (losses / world).tolist(), "adapters": lit.adapters, "packed": lit.packed}  # type: ignore[attr-defined]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_trainer_trains_a_qlora_model_like_one_process(tmp_path: Path, strategy: str) -> None:
    outs = run_distributed(_body, world_size=2, args=(str(tmp_path / "base"), strategy), **KW)
    want = _reference(str(tmp_path / "base"), 2)
    for out in outs:
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=0)
        assert out["adapters"].keys() == want["adapters"].keys() and out["adapters"]
        for name, value in want["adapters"].items():
            torch.testing.assert_close(
                out["adapters"][name], value, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert bool(out["packed"]) == (strategy == "zero3")  # stage 3: the 4-bit base partitioned
