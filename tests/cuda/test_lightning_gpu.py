"""``Trainer(accelerator="gpu", devices=1, strategy="zero3")``: fit, validate, ModelCheckpoint and resume on
one GPU, against Lightning's own DDP on the same GPU.

Every run is a real ``Trainer.fit`` in a worker of tests/harness.py (a fresh process: Lightning creates
its NCCL process group there and the worker destroys it afterwards), with tests/lightning/common.py's
module, data and probes. DDP on one device is the reference because it shards the data with the same
DistributedSampler as the strategy. Tolerances as in tests/lightning/test_trainer.py: losses rtol 1e-5,
weights atol 1e-6 (fp32; the same cuBLAS kernels run on the same shapes, the reductions differ).
Resume: one epoch with ModelCheckpoint(save_last=True), then ``fit(ckpt_path=last)`` for a second epoch,
against one uninterrupted two-epoch run of the strategy: the same losses and weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.cuda.common import ACCELERATOR, ON_GPU, PROCESS_ENV, requires_gpu
from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, fit_run

pytestmark = [requires_gpu, pytest.mark.multiprocess]

TRAINER = {"accelerator": ACCELERATOR, "devices": 1, "gradient_clip_val": 4.5, "max_epochs": 2}
MODEL = {"optimizer": "sgd", "lr": 0.1, "scheduler": "step"}
STEPS_PER_EPOCH = 16  # 64 rows, batch 4, one rank


class DeviceProbe(pl.Callback):
    """Where the strategy, the engine and the gathered parameters were at the start of training."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from ds_strategy.zero import GatheredParameters

        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        with GatheredParameters(list(pl_module.parameters())):
            params = sorted({str(p.device) for p in pl_module.parameters()})
        self.seen = {"root": str(trainer.strategy.root_device), "engine": str(engine.device), "params": params}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.seen)


def _run(strategy: str, trainer: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    (out,) = run_distributed(
        fit_run,
        1,
        args=(strategy, trainer, MODEL),
        kwargs=kwargs,
        env=ELASTIC_ENV,
        # Lightning's DDP is the reference, not under test: a rehearsal runs it without the strict mode.
        process_env=PROCESS_ENV if strategy != "ddp" or ON_GPU else {"DS_STRATEGY_DEVICE_STRICT": "0"},
        init_process_group=False,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run("ddp", TRAINER, then=("validate",), features_dir=str(tmp_path_factory.mktemp("ddp")))


def _assert_close_runs(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert len(got["losses"]) == len(ref["losses"]) > 0
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, w in ref["weights"].items():
        # On the host: the strategy may hand stage-3 weights back on the CPU, DDP keeps them on the GPU.
        torch.testing.assert_close(got["weights"][name].cpu(), w.cpu(), rtol=0, atol=1e-6, msg=f"weight {name}")


def test_zero3_fit_and_validate_match_ddp_on_the_gpu(ddp: dict[str, Any], tmp_path: Path) -> None:
    got = _run("zero3", TRAINER, then=("validate",), features_dir=str(tmp_path))
    assert got["strategy"] == "ZeroStrategy" and got["stage"] == 3 and got["world_size"] == 1
    assert got["engine"]["stage"] == 3 and got["engine"]["compute_dtype"] == "torch.float32"
    assert got["global_step"] == ddp["global_step"] == 2 * STEPS_PER_EPOCH
    _assert_close_runs(got, ddp)
    assert got["lrs"] == ddp["lrs"]
    assert got["validate"][0]["val_loss"] == pytest.approx(ddp["validate"][0]["val_loss"], rel=1e-5)
    assert got["metrics"]["val_mse"] == pytest.approx(ddp["metrics"]["val_mse"], rel=1e-5)
    # ModelCheckpoint wrote a sharded directory; consolidated, it holds DDP's weights at the same step
    # (saved when val_loss improved).
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()
    saved, ref = got["last_ckpt"], ddp["last_ckpt"]
    assert saved["global_step"] == ref["global_step"] > 0
    for name, w in ref["state_dict"].items():
        torch.testing.assert_close(
            saved["state_dict"][name].float().cpu(), w.float().cpu(), rtol=0, atol=1e-6, msg=name
        )


def test_zero3_resume_from_model_checkpoint_on_the_gpu(tmp_path: Path) -> None:
    first = _run("zero3", {**TRAINER, "max_epochs": 1}, features_dir=str(tmp_path))
    assert first["global_step"] == STEPS_PER_EPOCH
    resumed = _run("zero3", TRAINER, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    whole = _run("zero3", TRAINER)
    assert resumed["global_step"] == whole["global_step"] == 2 * STEPS_PER_EPOCH
    assert len(resumed["losses"]) == STEPS_PER_EPOCH  # the second epoch only
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(whole["losses"][STEPS_PER_EPOCH:]), rtol=1e-5, atol=0
    )
    for name, w in whole["weights"].items():
        torch.testing.assert_close(resumed["weights"][name].cpu(), w.cpu(), rtol=0, atol=1e-6, msg=name)


def test_the_engine_and_the_parameters_live_on_the_gpu() -> None:
    """The Trainer's strategy, its engine and the gathered parameters are on cuda:0 (the strict mode's cpu:0
    in a rehearsal)."""
    out = _run("zero3", {**TRAINER, "max_epochs": 1, "callbacks": [DeviceProbe()]})
    expected = "cuda:0" if ON_GPU else "cpu:0"
    assert out["callbacks"]["DeviceProbe"] == {"root": expected, "engine": expected, "params": [expected]}
