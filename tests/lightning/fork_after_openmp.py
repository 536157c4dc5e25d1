"""Run as a script by test_launcher.py: fork ZeRO workers after torch's OpenMP pool started in the parent."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch

from ds_strategy.lightning import ZeroStrategy, launcher
from tests.lightning.common import LitNet

launcher.PROBE_TIMEOUT_S = 1.0


def main() -> None:
    assert launcher.forked_child_can_compute(2), "a fresh process forks fine"
    torch.ones(1 << 22).mul_(2.0)  # a parallel op: the OpenMP pool is running now
    assert not launcher.forked_child_can_compute(2), "a multi-threaded forked child hangs"
    assert launcher.forked_child_can_compute(1), "a single-threaded one does not"
    pl.seed_everything(0, verbose=False)
    model = LitNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=2, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert any("they run with 1 thread" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert trainer.state.finished and trainer.callback_metrics["train_loss"] > 0
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items() if k.startswith("net"))
    print("FORK-AFTER-OPENMP-OK")


if __name__ == "__main__":
    main()
