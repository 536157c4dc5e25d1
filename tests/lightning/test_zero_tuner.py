"""``ZeroTuner(trainer).autotune(model, ...)`` then ``trainer.fit`` (issue 44, criterion 1: the Lightning face),
on 2 CPU ranks inside the harness's worker pool (tests/lightning/common.py says how), and its refusals."""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

import ds_strategy.lightning as zl
from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, EngineProbe, LitNet, Regression

pytestmark = pytest.mark.multiprocess


class RegressionData(pl.LightningDataModule):
    """The tests' regression rows, batched by ``batch_size`` (what the tuner sets)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.setups = 0

    def setup(self, stage: str) -> None:
        self.setups += 1

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Regression(), batch_size=self.batch_size, shuffle=True)


def _tuning(tmp: str) -> dict[str, Any]:
    return {
        "enabled": True,
        "start_profile_step": 1,
        "end_profile_step": 2,
        "num_tuning_micro_batch_sizes": 2,
        "tuner_early_stopping": 10,
        "results_dir": f"{tmp}/results",
        "exps_dir": f"{tmp}/exps",
    }


QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def _trainer(config: dict[str, Any], world: int, probe: EngineProbe) -> pl.Trainer:
    strategy = zl.ZeroStrategy(config=config)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, callbacks=[probe], **QUIET)


def _tune_then_fit(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from ds_strategy.autotuning import SearchSpace

    saved_env = dict(os.environ)  # Lightning sets PL_GLOBAL_SEED etc.; the pooled worker outlives this run
    try:
        pl.seed_everything(0, verbose=False)
        space = SearchSpace(stages=(0, 2), offload_optimizer=("none",), activation_checkpointing=(False,))
        # A datamodule with batch_size: the micro batch is tuned (global batch 4 x 2 x 2 ranks = 16 held: per
        # rank 8, micro batches 4 and 8, the two largest dividing it).
        probe = EngineProbe()
        trainer = _trainer({"autotuning": _tuning(f"{tmp}/dm")}, world, probe)
        trainer.accumulate_grad_batches = 2
        model, dm = LitNet(), RegressionData(batch_size=4)
        result = zl.ZeroTuner(trainer).autotune(model, datamodule=dm, space=space)
        assert result.best is not None and result.best_config is not None
        strategy = trainer.strategy
        assert isinstance(strategy, zl.ZeroStrategy)
        out: dict[str, Any] = {
            "best": result.best.candidate.knobs(),
            "config_is_winner": strategy.raw_config == result.best_config,
            "stage": strategy.stage,
            "accumulate": trainer.accumulate_grad_batches,
            "dm_batch_size": dm.batch_size,
            "trials": [t.candidate.name for t in result.trials],
        }
        trainer.fit(model, datamodule=dm)
        out["losses"] = model.train_losses
        out["engine"] = {k: probe.info[k] for k in ("stage", "micro_batch", "gradient_accumulation_steps")}

        # A DataLoader given as it is: its batch size (2) is kept, the rest tuned (global 2 x 1 x 2 = 4).
        probe = EngineProbe()
        trainer = _trainer({"autotuning": _tuning(f"{tmp}/loader")}, world, probe)
        model, loader = LitNet(), DataLoader(Regression(), batch_size=2)
        fixed = zl.ZeroTuner(trainer).autotune(model, train_dataloaders=loader, space=space)
        assert fixed.best is not None
        trainer.fit(model, train_dataloaders=loader)
        out["fixed"] = {
            "micro_batches": sorted({t.candidate.micro_batch for t in fixed.trials}),
            "engine": {k: probe.info[k] for k in ("stage", "micro_batch")},
            "best_stage": fixed.best.candidate.stage,
            "losses": model.train_losses,
        }
        return out
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.mark.slow
def test_tune_then_fit_trains_with_the_winner(tmp_path: Any) -> None:
    results = run_distributed(_tune_then_fit, 2, args=(str(tmp_path),), env=ELASTIC_ENV, init_process_group=False)
    assert results[0]["best"] == results[1]["best"]  # every rank agrees
    for out in results:
        best = out["best"]
        assert out["config_is_winner"] and out["stage"] == best["stage"]
        assert best["micro_batch"] * best["accumulation"] * 2 == 16  # the global batch held
        assert out["accumulate"] == best["accumulation"] and out["dm_batch_size"] == best["micro_batch"]
        assert set(out["trials"]) == {f"z{s}_mb{m}" for s in (0, 2) for m in (4, 8)}
        assert out["engine"] == {
            "stage": best["stage"],
            "micro_batch": best["micro_batch"],
            "gradient_accumulation_steps": best["accumulation"],
        }
        # 64 rows, 2 ranks: 32 per rank in batches of the winner's micro batch, every loss finite.
        assert len(out["losses"]) == 32 // best["micro_batch"]
        assert all(math.isfinite(v) for v in out["losses"])
        fixed = out["fixed"]
        assert fixed["micro_batches"] == [2]
        assert fixed["engine"] == {"stage": fixed["best_stage"], "micro_batch": 2}
        assert len(fixed["losses"]) == 16 and all(math.isfinite(v) for v in fixed["losses"])
    assert (tmp_path / "dm" / "results" / "ds_config.json").exists()


def test_refusals() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="ZeroTuner tunes a ZeroStrategy's configuration"):
        zl.ZeroTuner(trainer).autotune(LitNet())
    trainer = pl.Trainer(strategy=zl.ZeroStrategy(), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(AttributeError, match="expose batch_size"):
        zl.ZeroTuner(trainer).autotune(LitNet())  # LitNet builds its loader with batch_size=4, no attribute
    with pytest.raises(ValueError, match="manual optimization"):
        zl.ZeroTuner(trainer).autotune(LitNet(manual=True))
    disabled = pl.Trainer(
        strategy=zl.ZeroStrategy(config={"autotuning": {"enabled": False}}), accelerator="cpu", devices=1, logger=False
    )
    with pytest.raises(ValueError, match='"enabled": false'):
        zl.ZeroTuner(disabled).autotune(LitNet(), datamodule=RegressionData(4))
