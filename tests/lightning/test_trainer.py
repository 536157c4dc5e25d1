"""The Trainer on 2 CPU ranks with every strategy name: parity with Trainer(strategy="ddp") and the features.

Every run is a real ``Trainer.fit`` on 2 ranks inside the harness's worker pool (tests/lightning/common.py
says how). The reference is Lightning's own DDP with the same seed, data, sampler, accumulation, clipping
and scheduler.

Tolerances (fp32): losses rtol 1e-5, weights atol 1e-6. The engine averages gradients with its own
bucketed collectives and clips with its global-norm formula, torch DDP with its reducer and
``clip_grad_norm_``: the same math, rounded in other places (observed over 16 micro-batches / 8 steps:
losses within 1.7e-7 relative, weights within 1.2e-7 absolute, for every name).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ds_strategy.lightning as zl
from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, fit_run, raises_run

pytestmark = pytest.mark.multiprocess

# Accumulation 2 over 8 micro-batches per rank per epoch, a scheduler stepping every 2 optimizer steps,
# validate/test/predict after fit. SGD with momentum (unlike Adam it sees the gradient's scale) and a
# clipping threshold between the gradient norms of different steps (~4.2-5.6): some steps are clipped,
# some are not, so both a wrong clip and a wrong gradient scale change the trajectory.
CLIP = 4.5
TRAINER = {"accumulate_grad_batches": 2, "gradient_clip_val": CLIP, "max_epochs": 2}
MODEL = {"scheduler": "step", "optimizer": "sgd", "lr": 0.1}
THEN = ("validate", "test", "predict")
NAMES = ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_sharded", "zero3_offload", "zero3_nvme"]


def _run(strategy: Any, trainer: dict[str, Any], model: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    return run_distributed(
        fit_run, 2, args=(strategy, trainer, model), kwargs=kw, env=ELASTIC_ENV, init_process_group=False
    )


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run("ddp", TRAINER, MODEL, then=THEN, features_dir=str(tmp_path_factory.mktemp("ddp")))


def _assert_parity(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == 16
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-6, msg=f"weight {name}")
    assert got["lrs"] == ref["lrs"]
    assert got["global_step"] == ref["global_step"] == 8
    for key in ("val_loss", "val_mse", "train_loss"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5), key
    assert got["validate"][0]["val_loss"] == pytest.approx(ref["validate"][0]["val_loss"], rel=1e-5)
    assert got["test"][0]["test_loss"] == pytest.approx(ref["test"][0]["test_loss"], rel=1e-5)
    torch.testing.assert_close(got["predict"], ref["predict"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_name_matches_ddp(name: str, ddp: list[dict[str, Any]], tmp_path: Any) -> None:
    """fit/validate/test/predict, accumulation, clipping, a step scheduler, sync_dist logging, a
    torchmetrics metric, ModelCheckpoint/EarlyStopping/LearningRateMonitor and the progress bar, per name."""
    runs = _run(name, TRAINER, MODEL, then=THEN, features_dir=str(tmp_path))
    for rank, (got, ref) in enumerate(zip(runs, ddp, strict=True)):
        assert got["strategy"] == "ZeroStrategy" and got["stage"] == int(name[4]), rank
        assert got["sampler"] == "DistributedSampler"
        _assert_parity(got, ref)
        engine = got["engine"]
        assert engine["stage"] == int(name[4])
        assert engine["gradient_clipping"] == CLIP and engine["gradient_accumulation_steps"] == 2
        norms = engine["grad_norms"]
        assert len(norms) == 8 and min(norms) < CLIP < max(norms), norms  # clipping engaged on some steps only
        assert engine["micro_batch"] == 4  # inferred from the train dataloader
        # What lightning_module_state_dict() gives after fit (a notebook kernel's weights): the full model;
        # at stage 3 only on rank 0 (assembled there when asked, after teardown), nothing elsewhere.
        if name.startswith("zero3") and rank > 0:
            assert got["final_state"] == {}
        else:
            assert got["final_state"].keys() == ref["weights"].keys()
            for k, w in ref["weights"].items():
                torch.testing.assert_close(got["final_state"][k], w, rtol=0, atol=1e-6, msg=k)
        assert engine["precision_plugin"] == "ZeroPrecision"
    # The callbacks ran: a best and a last checkpoint, EarlyStopping counted, the lr monitor saw the schedule.
    cbs = runs[0]["callbacks"]
    assert cbs["ModelCheckpoint"]["best"].endswith(".ckpt") and cbs["ModelCheckpoint"]["last"].endswith("last.ckpt")
    assert (tmp_path / "ckpt" / "last.ckpt").is_dir()  # sharded: a directory (tests/lightning/test_checkpoint.py)
    assert cbs["EarlyStopping"]["stopped_epoch"] == 0
    assert cbs["LearningRateMonitor"]["lr-SGD"] == ddp[0]["callbacks"]["LearningRateMonitor"]["lr-SGD"]
    # The checkpoint holds the same full weights as DDP's at the same step (saved when val_loss improved).
    saved, ref = runs[0]["last_ckpt"], ddp[0]["last_ckpt"]
    assert saved["global_step"] == ref["global_step"] > 0
    for k, w in ref["state_dict"].items():
        torch.testing.assert_close(saved["state_dict"][k].float(), w.float(), rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("clip", [None, CLIP], ids=["no-clip", "clip_gradients"])
def test_manual_optimization_matches_ddp(clip: float | None) -> None:
    """automatic_optimization=False, two manual_backward calls per optimizer.step(); with ``clip``, the
    module's ``self.clip_gradients(opt, clip, "norm")`` before it (the engine clips that step: the gradients
    are no ``.grad`` to clip in place), with SGD, which sees the gradient's scale."""
    trainer = {"max_epochs": 1}
    model: dict[str, Any] = {"manual": True}
    if clip is not None:
        model.update(optimizer="sgd", lr=0.1, manual_clip=clip)
    ref = _run("ddp", trainer, model)
    for name in ("zero1", "zero2", "zero3"):
        got = _run(name, trainer, model)
        for g, r in zip(got, ref, strict=True):
            torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=0)
            for k, w in r["weights"].items():
                torch.testing.assert_close(g["weights"][k], w, rtol=0, atol=1e-6)
            assert g["engine"]["global_steps"] == 8
            assert g["engine"]["gradient_clipping"] == 0.0  # the config's: the request was for one step each
            if clip is not None:
                norms = g["engine"]["grad_norms"]
                assert min(norms) < clip < max(norms), norms  # clipped on some steps only


@pytest.mark.parametrize("name", ["zero0_checkpointed", "zero2_checkpointed", "zero3_checkpointed"])
def test_activation_checkpointing_policy_matches_ddp(name: str, ddp: list[dict[str, Any]], tmp_path: Any) -> None:
    """activation_checkpointing_policy={nn.Linear}: the same run as DDP without checkpointing (issue 20)."""
    runs = _run(name, TRAINER, MODEL, then=THEN, features_dir=str(tmp_path))
    for got, ref in zip(runs, ddp, strict=True):
        _assert_parity(got, ref)


def test_activation_checkpointing_policy_composes_with_configure_model_at_stage_3() -> None:
    """Layers built in configure_model under zero.Init, then checkpointed, then partitioned by the engine."""
    runs = _run("zero3_checkpointed", {"max_epochs": 3}, {"scheduler": "epoch", "build_in_configure_model": True})
    for got in runs:
        assert got["built_in_configure_model"]
        assert got["losses"][-1] < got["losses"][0] / 2


@pytest.mark.parametrize("name", ["zero1", "zero3"])
def test_epoch_scheduler_and_configure_model(name: str) -> None:
    """An epoch-interval scheduler, and layers built in configure_model (under stage 3: zero.Init)."""
    runs = _run(name, {"max_epochs": 3}, {"scheduler": "epoch", "build_in_configure_model": True})
    for got in runs:
        assert got["built_in_configure_model"]
        # Recorded after each of the 8 batches per epoch; the epoch step lands before the last batch's hook.
        assert got["lrs"] == [0.05] * 7 + [0.025] * 8 + [0.0125] * 8 + [0.00625]
        assert got["losses"][-1] < got["losses"][0] / 2


def test_config_optimizer_and_scheduler() -> None:
    """configure_optimizers returns None: the optimizer and a WarmupLR come from the config; Lightning
    steps that scheduler per optimizer step."""
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 4},
        },
    }
    strategy = zl.ZeroStrategy(stage=2, config=config)
    runs = _run(strategy, {"max_epochs": 1}, {"return_optimizer": False})
    got = runs[0]
    assert got["engine"]["optimizer"] == "CPUAdam"  # the config's AdamW on CPU: the C++ kernel
    assert got["lrs"][:4] == pytest.approx([0.05 * i / 4 for i in range(4)], abs=0.02)  # warming up
    assert got["lrs"][-1] == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("precision", "name", "dtype"),
    [("bf16-mixed", "zero2", "torch.bfloat16"), ("16-true", "zero1", "torch.float16")],
)
def test_precision_maps_onto_the_engine(precision: str, name: str, dtype: str, ddp: list[dict[str, Any]]) -> None:
    """The precision flag selects the engine's 16-bit mode; fp16's loss scale comes from the config."""
    strategy: Any = name
    if precision == "16-true":
        strategy = zl.ZeroStrategy(stage=1, config={"fp16": {"initial_scale_power": 8, "loss_scale_window": 4}})
    runs = _run(strategy, {**TRAINER, "precision": precision}, MODEL)
    for got, ref in zip(runs, ddp, strict=True):
        engine = got["engine"]
        assert engine["compute_dtype"] == dtype and engine["param_dtype"] == dtype
        assert engine["precision_plugin"] == "ZeroPrecision"
        if precision == "16-true":
            # 2**8 start, doubled after 5 clean steps, then every 4 (DeepSpeed's count), over 8 steps: 2**9.
            assert engine["skipped_steps"] == 0 and engine["loss_scale"] == 2.0**9
        # 16-bit training tracks the fp32 run (bf16 has 8 bits of mantissa): losses within 5%.
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=5e-2, atol=0)


@pytest.mark.parametrize(
    ("trainer", "model", "message"),
    [
        ({"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, {}, "global norm only"),
        (
            {},
            {"optimizers": 2, "manual": True},
            "ZeroStrategy trains with one optimizer, but configure_optimizers returned 2",
        ),
        ({}, {"return_optimizer": False}, "ZeroStrategy needs an optimizer to fit"),
    ],
)
def test_clear_errors(trainer: dict[str, Any], model: dict[str, Any], message: str) -> None:
    errors = run_distributed(raises_run, 2, args=("zero2", trainer, model), env=ELASTIC_ENV, init_process_group=False)
    for err in errors:
        assert message in err
