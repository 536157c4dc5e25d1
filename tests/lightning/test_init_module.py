"""``Trainer.init_module()`` under ZeRO stage 3 builds the model partitioned (as ``configure_model`` does) when
the ranks already run (torchrun here), and the fit then trains exactly like one from a plain build."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, LitNet


def _fit(rank: int, world: int, use_init_module: bool) -> dict[str, Any]:
    import ds_strategy.lightning  # noqa: F401
    from ds_strategy.runtime.zero.init import init_shard

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="zero3",
        accelerator="cpu",
        devices=world,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's generic "cannot fully support" note for sharded strategies
        if use_init_module:
            with trainer.init_module():
                model = LitNet()
        else:
            model = LitNet()
    partitioned = [n for n, p in model.named_parameters() if init_shard(p) is not None]
    trainer.fit(model)
    return {"partitioned": partitioned, "names": [n for n, _ in model.named_parameters()], "losses": model.train_losses}


@pytest.mark.multiprocess
def test_init_module_builds_partitioned_and_trains_like_a_plain_build() -> None:
    kw = {"env": ELASTIC_ENV, "init_process_group": False}
    sharded = run_distributed(_fit, 2, args=(True,), **kw)
    plain = run_distributed(_fit, 2, args=(False,), **kw)
    for got, ref in zip(sharded, plain, strict=True):
        assert got["partitioned"] == got["names"]  # every parameter was a zero.Init shard before fit
        assert ref["partitioned"] == []
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=1e-7)
