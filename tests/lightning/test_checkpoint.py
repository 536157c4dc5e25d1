"""Lightning checkpoints through the engine's sharded format: ModelCheckpoint, fit(ckpt_path=...),
trainer.save_checkpoint, consolidation, resume at another world size, single-file (weights-only) resume.

Every run is a real ``Trainer.fit`` inside the harness's worker pool (see tests/lightning/common.py). The
model: 64 rows, batch 4, so 8 optimizer steps per epoch on 2 ranks; Adam; validation every epoch.

Exact resume: N=3 epochs with ModelCheckpoint(monitor="step", mode="max", save_top_k=2, save_last=True)
(every epoch improves, so every epoch saves: the third save deletes the first directory), then
``fit(ckpt_path="last")`` with max_epochs=N+M against one uninterrupted N+M run. Expected bit-identical in
fp32 on CPU (the comparisons use rtol=atol=0): the engine restores the exact fp32 masters, Adam moments and
step counts, Lightning the loops and the scheduler, and the data order depends only on the epoch
(DistributedSampler), so the resumed run computes the same operations on the same values in the same order.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ds_strategy.lightning  # noqa: F401 - registers the strategy names
from tests.harness import DistributedTestError, run_distributed
from tests.lightning.common import ELASTIC_ENV, LitNet, LrRecorder, make_strategy

pytestmark = pytest.mark.multiprocess

N, M = 3, 2  # epochs before and after the interruption
STEPS_PER_EPOCH = 8  # at 2 ranks


class StartProbe(Callback):
    """What training resumed from: step counter, full weights, the optimizer's step count (on rank 0)."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        optimizer = engine.optimizer if engine is not None else trainer.optimizers[0]
        steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
        self.info = {
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "engine_steps": engine.global_steps if engine is not None else None,
            "adam_steps": sorted(set(steps)),
            "weights": {k: v.detach().float().clone() for k, v in pl_module.state_dict().items()},
        }


class SaveAtEnd(Callback):
    """``trainer.save_checkpoint(path)`` at the end of training, while the engine is still there."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def _fit(
    rank: int,
    world_size: int,
    name: str,
    max_epochs: int,
    model_kwargs: dict[str, Any],
    ckpt_dir: str | None = None,
    ckpt_path: str | None = None,
    save_at_end: str | None = None,
    save_after_fit: str | None = None,
    validate_ckpt: str | None = None,
    precision: str = "32-true",
) -> dict[str, Any]:

    saved_env = dict(os.environ)  # Lightning sets PL_GLOBAL_SEED etc.; the pooled worker outlives this run
    try:
        pl.seed_everything(0, verbose=False)
        model = LitNet(**model_kwargs)
        lrs, probe = LrRecorder(), StartProbe()
        callbacks: list[Callback] = [lrs, probe]
        if ckpt_dir is not None:
            # monitor "step", mode "max": every epoch is a new best, so top-2 deletes one directory per epoch.
            callbacks.append(
                ModelCheckpoint(
                    dirpath=ckpt_dir, filename="{epoch}", monitor="step", mode="max", save_top_k=2, save_last=True
                )
            )
        if save_at_end is not None:
            callbacks.append(SaveAtEnd(save_at_end))
        trainer = pl.Trainer(
            strategy=make_strategy(name),
            accelerator="cpu",
            devices=world_size,
            max_epochs=max_epochs,
            precision=precision,  # type: ignore[arg-type]
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=ckpt_dir is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, ckpt_path=ckpt_path)
        if save_after_fit is not None:
            trainer.save_checkpoint(save_after_fit)
        validated = None
        if validate_ckpt is not None:  # weights only, through the engine built for validation
            trainer.validate(model, ckpt_path=validate_ckpt, verbose=False)
            validated = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        return {
            "validated": validated,
            "losses": list(model.train_losses),
            "weights": {k: v.detach().float().clone() for k, v in model.state_dict().items()},
            "lrs": lrs.lrs,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "start": probe.info,
            "warnings": [str(w.message) for w in caught],
        }
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _run(world_size: int, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    return run_distributed(_fit, world_size, args=args, kwargs=kwargs, env=ELASTIC_ENV, init_process_group=False)


def _assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == ref.keys(), what
    for k, w in ref.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=0, msg=f"{what}: {k}")


# Each name with a scheduler: "step" (stepped every 2 optimizer steps) or "epoch" (stepped after every
# epoch's validation, which is where ModelCheckpoint saves: the resume must step it exactly once), and a
# precision (bf16-mixed: the checkpoint holds the fp32 masters, so the resume is exact too).
CASES = [
    ("zero0", "step", "32-true"),
    ("zero1", "step", "32-true"),
    ("zero2", "epoch", "32-true"),
    ("zero2_offload", "step", "32-true"),
    ("zero2", "step", "bf16-mixed"),
    ("zero3", "epoch", "32-true"),
]


@pytest.fixture(scope="module")
def zero2_first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """zero2, N epochs, ModelCheckpoint into ckpt/, and trainer.save_checkpoint(final.ckpt) at train end."""
    root = tmp_path_factory.mktemp("zero2")
    runs = _run(2, "zero2", N, {"scheduler": "epoch"}, str(root / "ckpt"), save_at_end=str(root / "final.ckpt"))
    # A copy of the epoch-3 state for the tests below: the resume test goes on writing into ckpt/.
    shutil.copytree(root / "ckpt" / "last.ckpt", root / "epoch3.ckpt")
    return root, runs


@pytest.mark.parametrize(("name", "scheduler", "precision"), CASES)
def test_resume_from_last_matches_uninterrupted(
    name: str, scheduler: str, precision: str, tmp_path: Path, zero2_first: tuple[Path, list[dict[str, Any]]]
) -> None:
    model = {"scheduler": scheduler}
    if (name, scheduler, precision) == ("zero2", "epoch", "32-true"):
        root, first = zero2_first
        ckpt = root / "ckpt"
    else:
        ckpt = tmp_path / "ckpt"
        first = _run(2, name, N, model, str(ckpt), precision=precision)
    # ModelCheckpoint wrote directories (one tag each), kept the best 2 of 3 and the last one.
    entries = sorted(p.name for p in ckpt.iterdir())
    assert entries == ["epoch=1.ckpt", "epoch=2.ckpt", "last.ckpt"], entries  # epoch=0.ckpt was removed
    for entry in entries:
        assert (ckpt / entry / "latest").read_text().strip() == "checkpoint"
        assert sorted(f.name for f in (ckpt / entry / "checkpoint").iterdir()) == [
            "meta.pt",
            "model_states.pt",
            "zero_rank_00000_optim_states.pt",
            "zero_rank_00001_optim_states.pt",
        ]
    assert first[0]["global_step"] == N * STEPS_PER_EPOCH

    resumed = _run(2, name, N + M, model, str(ckpt), ckpt_path="last", precision=precision)
    # ModelCheckpoint's state came back with the trainer's: it goes on keeping the best two, deleting the rest.
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=3.ckpt", "epoch=4.ckpt", "last.ckpt"]
    reference = _run(2, name, N + M, model, precision=precision)
    for rank, (got, ref) in enumerate(zip(resumed, reference, strict=True)):
        start = got["start"]
        assert start["global_step"] == start["engine_steps"] == N * STEPS_PER_EPOCH, rank
        assert start["epoch"] == N
        assert start["adam_steps"] == [float(N * STEPS_PER_EPOCH)]  # the optimizer state came back
        assert got["losses"] == ref["losses"][N * STEPS_PER_EPOCH :], rank  # bit-identical
        assert got["lrs"] == ref["lrs"][N * STEPS_PER_EPOCH :], rank
        assert len(set(got["lrs"])) > 1  # the schedule moves within the resumed part
        _assert_same(got["weights"], ref["weights"], f"rank {rank} weights after resume")
        assert got["global_step"] == ref["global_step"] == (N + M) * STEPS_PER_EPOCH


def test_save_checkpoint_consolidates_for_load_from_checkpoint(
    tmp_path: Path, zero2_first: tuple[Path, list[dict[str, Any]]]
) -> None:
    """trainer.save_checkpoint(path) -> ds-zero-to-fp32 --lightning -> LitNet.load_from_checkpoint: the
    trained weights, exactly, and the hyperparameters."""
    from ds_strategy.runtime.checkpoint.consolidate import main as zero_to_fp32

    root, first = zero2_first
    assert (root / "final.ckpt" / "checkpoint" / "meta.pt").is_file()
    out = tmp_path / "final_fp32.ckpt"
    assert zero_to_fp32([str(root / "final.ckpt"), str(out), "--lightning"]) == 0
    loaded = LitNet.load_from_checkpoint(str(out))
    assert loaded.hparams["scheduler"] == "epoch"
    _assert_same({k: v.float() for k, v in loaded.state_dict().items()}, first[0]["weights"], "consolidated")
    assert torch.load(out, weights_only=True)["global_step"] == N * STEPS_PER_EPOCH


def test_resume_at_one_rank(zero2_first: tuple[Path, list[dict[str, Any]]]) -> None:
    """Saved by 2 ranks, resumed by 1 (no conversion): the weights, the optimizer's step count and the
    trainer's progress continue; the remaining epochs run 16 steps each at batch 4 on one rank. Then
    trainer.validate(ckpt_path=...) loads the directory's weights into the evaluation engine."""
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

    root, first = zero2_first
    last = root / "epoch3.ckpt"
    expected = consolidate_fp32_state_dict(last)
    (got,) = _run(1, "zero2", N + M, {"scheduler": "epoch"}, ckpt_path=str(last), validate_ckpt=str(last))
    start = got["start"]
    _assert_same(start["weights"], {k: v.float() for k, v in expected.items()}, "weights at resume")
    _assert_same(start["weights"], first[0]["weights"], "weights at resume vs the 2-rank run")
    assert start["global_step"] == N * STEPS_PER_EPOCH and start["epoch"] == N
    assert start["adam_steps"] == [float(N * STEPS_PER_EPOCH)]
    assert got["global_step"] == N * STEPS_PER_EPOCH + M * 2 * STEPS_PER_EPOCH
    # StepLR(gamma=0.5) per epoch from 0.05, stepped after epochs 0-2 before the save: 0.05 / 8 from the first
    # resumed batch, then once per epoch, never twice (recorded after each batch; the epoch's step lands
    # before its last batch's hook, as in tests/lightning/test_trainer.py).
    per_epoch = 2 * STEPS_PER_EPOCH
    assert got["lrs"] == [0.05 / 8] * (per_epoch - 1) + [0.05 / 16] * per_epoch + [0.05 / 32]
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    # trainer.validate(ckpt_path=<directory>) after that fit: back to the checkpoint's weights.
    _assert_same(got["validated"], {k: v.float() for k, v in expected.items()}, "weights in validate")


def test_single_file_checkpoint_loads_weights_only(
    tmp_path: Path, zero2_first: tuple[Path, list[dict[str, Any]]]
) -> None:
    """A single-file Lightning checkpoint (here: written by trainer.save_checkpoint after fit, when the engine
    is released) resumes with its weights and loop progress, a fresh optimizer, and a warning saying so."""
    root, _ = zero2_first
    single = tmp_path / "after_fit.ckpt"
    # 1 epoch from the zero2 checkpoint directory, then a save after fit: a plain file from rank 0.
    _run(2, "zero2", N + 1, {"scheduler": "epoch"}, ckpt_path=str(root / "epoch3.ckpt"), save_after_fit=str(single))
    assert single.is_file()
    plain = torch.load(single, weights_only=False)
    assert "optimizer_states" not in plain and plain["global_step"] == (N + 1) * STEPS_PER_EPOCH
    runs = _run(2, "zero1", N + 2, {"scheduler": "epoch"}, ckpt_path=str(single))
    for rank, got in enumerate(runs):
        start = got["start"]
        _assert_same(start["weights"], {k: v.float() for k, v in plain["state_dict"].items()}, f"rank {rank}")
        assert start["global_step"] == (N + 1) * STEPS_PER_EPOCH  # loops restored from the file
        assert start["adam_steps"] == []  # fresh optimizer state
        assert got["global_step"] == (N + 2) * STEPS_PER_EPOCH
    assert any("optimizer state starts fresh" in w for w in runs[0]["warnings"]), runs[0]["warnings"]


def test_save_after_fit_onto_a_checkpoint_directory_is_refused(
    tmp_path: Path, zero2_first: tuple[Path, list[dict[str, Any]]]
) -> None:
    """After fit the save is one file; onto a directory written during fit it would land inside it under a
    temporary name and loading the path would give the old weights: refused, naming the path."""
    root, _ = zero2_first
    target = tmp_path / "taken.ckpt"
    shutil.copytree(root / "epoch3.ckpt", target)
    with pytest.raises(DistributedTestError, match="is a checkpoint directory from during fit"):
        _run(2, "zero2", N + 1, {"scheduler": "epoch"}, ckpt_path=str(root / "epoch3.ckpt"), save_after_fit=str(target))


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_single_file_from_ddp_resumes_exactly(tmp_path: Path, strategy: str) -> None:
    """A DDP checkpoint (a single file with a torch optimizer state) resumed under ZeroStrategy: the Adam
    moments and step count are cut into the partitions and the param groups take the file's lr, so the
    resumed run continues as DDP's own resume does (same lrs, same weights)."""
    _run(2, "ddp", 2, {"scheduler": "step"}, str(tmp_path / "ckpt"))
    single = tmp_path / "ckpt" / "last.ckpt"
    assert single.is_file()
    ref = _run(2, "ddp", 3, {"scheduler": "step"}, ckpt_path=str(single))
    runs = _run(2, strategy, 3, {"scheduler": "step"}, ckpt_path=str(single))
    for rank, (got, want) in enumerate(zip(runs, ref, strict=True)):
        assert got["lrs"] == want["lrs"] and len(set(got["lrs"])) > 1, (got["lrs"], want["lrs"])
        assert got["global_step"] == want["global_step"] == 3 * STEPS_PER_EPOCH
        assert got["start"]["adam_steps"] == [float(2 * STEPS_PER_EPOCH)], got["start"]["adam_steps"]
        for k, w in want["weights"].items():  # DDP reduces in another order: not bit for bit
            torch.testing.assert_close(got["weights"][k], w, rtol=0, atol=1e-6, msg=f"rank {rank}: {k}")
    assert not any("starts fresh" in w for w in runs[0]["warnings"]), runs[0]["warnings"]
