"""``ZeroStrategy(exclude_frozen_parameters=True)``: Lightning checkpoints hold the trainable parameters only
(a LoRA run's adapters), and resuming from one keeps the model's own frozen values (issue 21, criterion 1).

The first layer of LitNet is frozen; 2 ranks at stage 3 (every parameter partitioned) fit one epoch and
save at the end. The checkpoint lists the frozen names as excluded and holds no frozen partition; a resume
into a model whose frozen layer was built from the same seed continues from the saved trainable weights
and trains exactly like the uninterrupted run (fp32, bit-identical).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, LitNet
from tests.lightning.test_checkpoint import SaveAtEnd


def _fit(rank: int, world: int, epochs: int, save: str | None, ckpt_path: str | None) -> dict[str, Any]:
    from ds_strategy.lightning import ZeroStrategy

    saved_env = dict(os.environ)
    try:
        pl.seed_everything(0, verbose=False)
        model = LitNet()
        model.net[0].requires_grad_(False)  # type: ignore[index]
        strategy = ZeroStrategy(
            stage=3,
            exclude_frozen_parameters=True,
            config={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        )
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world,
            max_epochs=epochs,
            callbacks=[SaveAtEnd(save)] if save else [],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, ckpt_path=ckpt_path)
        return {"losses": list(model.train_losses), "weights": {k: v.clone() for k, v in model.state_dict().items()}}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.mark.multiprocess
def test_exclude_frozen_parameters_writes_adapters_only_and_resumes(tmp_path: Path) -> None:
    kw = {"env": ELASTIC_ENV, "init_process_group": False}
    ckpt = tmp_path / "adapters.ckpt"
    run_distributed(_fit, 2, args=(1, str(ckpt), None), **kw)
    meta = torch.load(ckpt / "checkpoint" / "meta.pt", weights_only=False)
    assert meta["frozen_excluded"] == ["net.0.bias", "net.0.weight"] and meta["frozen_groups"] == []
    for rank_file in sorted((ckpt / "checkpoint").glob("zero_rank_*")):
        assert torch.load(rank_file, weights_only=False)["frozen"] == []
    resumed = run_distributed(_fit, 2, args=(2, None, str(ckpt)), **kw)
    straight = run_distributed(_fit, 2, args=(2, None, None), **kw)
    for got, ref in zip(resumed, straight, strict=True):
        assert got["losses"] == ref["losses"][len(ref["losses"]) - len(got["losses"]) :]
        assert got["weights"].keys() == ref["weights"].keys()
        for k, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][k], w, rtol=0, atol=0, msg=k)
