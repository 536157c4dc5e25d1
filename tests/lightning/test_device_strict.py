"""Lightning's zero2 / zero3 fits under the device-strict mode (``DS_STRATEGY_DEVICE_STRICT=1``, see
ds_strategy/accelerator/strict.py): every collective the strategy, the engine, Lightning's own syncs
(``self.log(sync_dist=True)``, torchmetrics) and the checkpoints issue carries device memory, and the run
trains exactly like Lightning's DDP (the same parity as tests/lightning/test_trainer.py)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, fit_run
from tests.lightning.test_trainer import MODEL, THEN, TRAINER, _assert_parity

pytestmark = pytest.mark.multiprocess

STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}


class DeviceProbe(pl.Callback):
    """Records, on each rank, whether the mode was on and where the engine and the strategy computed."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from ds_strategy.accelerator import strict

        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        self.seen = {"active": strict.ACTIVE, "root": str(trainer.strategy.root_device), "engine": str(engine.device)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.seen)


@pytest.fixture(scope="module")
def ddp() -> list[dict[str, Any]]:
    return run_distributed(
        fit_run, 2, args=("ddp", TRAINER, MODEL), kwargs={"then": THEN}, env=ELASTIC_ENV, init_process_group=False
    )


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_fit_under_the_strict_mode_matches_ddp(name: str, ddp: list[dict[str, Any]], tmp_path: Any) -> None:
    runs = run_distributed(
        fit_run,
        2,
        args=(name, {**TRAINER, "callbacks": [DeviceProbe()]}, MODEL),
        kwargs={"then": THEN, "features_dir": str(tmp_path)},  # ModelCheckpoint: sharded saves under the mode
        env=ELASTIC_ENV,
        process_env=STRICT,
        init_process_group=False,
        timeout=600,
    )
    for got, ref in zip(runs, ddp, strict=True):
        assert got["strategy"] == "ZeroStrategy" and got["stage"] == int(name[4])
        _assert_parity(got, ref)
        assert got["callbacks"]["DeviceProbe"] == {"active": True, "root": "cpu:0", "engine": "cpu:0"}
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_resume_under_the_strict_mode_matches_a_plain_resume(name: str, tmp_path: Any) -> None:
    """Load a sharded checkpoint (weights, optimizer state, counters) under the mode: the same run as
    without it."""
    common = {"env": ELASTIC_ENV, "init_process_group": False, "timeout": 600}
    # No accumulation: the test's engine probe reads a gradient norm at every batch end.
    trainer = {"gradient_clip_val": TRAINER["gradient_clip_val"], "max_epochs": 2}
    first = {**trainer, "max_epochs": 1}
    run_distributed(fit_run, 2, args=(name, first, MODEL), kwargs={"features_dir": str(tmp_path)}, **common)
    resumed = {"ckpt_path": str(tmp_path / "ckpt" / "last.ckpt")}
    strict = run_distributed(fit_run, 2, args=(name, trainer, MODEL), kwargs=resumed, process_env=STRICT, **common)
    plain = run_distributed(fit_run, 2, args=(name, trainer, MODEL), kwargs=resumed, **common)
    for got, ref in zip(strict, plain, strict=True):
        assert got["global_step"] == ref["global_step"] == 16
        assert got["losses"] == ref["losses"] and len(got["losses"]) == 8  # the second epoch only
        for key, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], w, rtol=0, atol=0, msg=key)
