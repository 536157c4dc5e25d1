"""``ModelCheckpoint(save_weights_only=True)`` under ZeroStrategy writes the weights only (issue 21, criterion 3).

2 ranks at stage 3 (every parameter partitioned) and stage 2 fit one epoch with a weights-only
ModelCheckpoint: the checkpoint's rank files hold the fp32 partitions and no optimizer state, ``meta.pt``
says so, and its consolidated weights equal the trained model's; resuming ``fit`` from it stops on every
rank with the error that names ``load_optimizer_states=False`` (as Lightning stops a DDP resume from a
weights-only file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, fit_run, raises_run

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("name", ["zero2", "zero3_sharded"])
def test_save_weights_only_writes_no_optimizer_state(name: str, tmp_path: Path) -> None:
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

    callback = ModelCheckpoint(dirpath=str(tmp_path), filename="w", save_weights_only=True)
    trainer: dict[str, Any] = {"max_epochs": 1, "callbacks": [callback], "enable_checkpointing": True}
    runs = run_distributed(fit_run, 2, args=(name, trainer, {}), env=ELASTIC_ENV, init_process_group=False)
    tag = tmp_path / "w.ckpt" / "checkpoint"
    meta = torch.load(tag / "meta.pt", weights_only=False)
    assert meta["optimizer_states_excluded"] is True
    for rank_file in sorted(tag.glob("zero_rank_*")):
        groups = torch.load(rank_file, weights_only=False)["groups"]
        assert groups and all(g["state"] == {} and g["fp32"].numel() > 0 for g in groups)
    saved = consolidate_fp32_state_dict(str(tmp_path / "w.ckpt"))
    for k, w in runs[0]["weights"].items():
        torch.testing.assert_close(saved[k], w, rtol=0, atol=0, msg=k)
    errors = run_distributed(
        raises_run, 2, args=(name, {"max_epochs": 2}, {}), kwargs={"ckpt_path": str(tmp_path / "w.ckpt")},
        env=ELASTIC_ENV, init_process_group=False,
    )  # fmt: skip
    for err in errors:
        assert "holds the weights only" in err and "load_optimizer_states=False" in err, err
