"""What the trials teach a tune (autotuning/refine.py): the memory model scaled by the measured floor of
``peak / predicted`` skips candidates that cannot fit, and the best trials run twice before one wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from ds_strategy.autotuning import Candidate, SearchSpace
from ds_strategy.autotuning import tune as tune_module
from ds_strategy.autotuning.refine import CALIBRATED, MARGIN, Calibration, combine, family
from ds_strategy.autotuning.trial import OK, OVER_CAP, TrialResult
from tests.autotuning.models import Net
from tests.harness import run_distributed

MIB = 1 << 20


def _c(stage: int, **knobs: Any) -> Candidate:
    return Candidate(**{"stage": stage, "micro_batch": 1, "accumulation": 8, **knobs})


def _trial(c: Candidate, status: str, peak: int, predicted: int, step_s: float | None = None) -> TrialResult:
    t = TrialResult(c, status, peak_bytes=peak, predicted_bytes=predicted, step_s=step_s)
    if step_s is not None:
        t.samples_per_s = 8 / step_s
    return t


def test_the_floor_is_per_family_and_falls_back_to_every_trial() -> None:
    cal = Calibration(cap=100 * MIB)
    z2, z3, z3_ac = _c(2), _c(3), _c(3, activation_checkpointing=True)
    assert cal.ratio(z2) is None and not cal.rules_out(z2, 10**12)  # nothing measured: nothing skipped
    cal.learn(_trial(z3, OK, 150 * MIB, 100 * MIB))
    cal.learn(_trial(_c(3, micro_batch=2), OVER_CAP, 260 * MIB, 200 * MIB))
    assert cal.ratio(z3) == pytest.approx(1.3)  # the family's smallest ratio
    assert cal.ratio(z2) == pytest.approx(1.3)  # no z2 trial yet: the smallest of all
    cal.learn(_trial(z3_ac, OK, 200 * MIB, 100 * MIB))
    assert cal.ratio(z3_ac) == pytest.approx(2.0) and cal.ratio(z2) == pytest.approx(1.3)
    # 80 MiB predicted x 1.3 x 0.95 = 98.8 MiB fits under 100; 82 x 1.3 x 0.95 = 101.3 does not.
    assert not cal.rules_out(z3, 80 * MIB) and cal.rules_out(z3, 82 * MIB)
    assert cal.expected(z3, 82 * MIB) == int(82 * MIB * 1.3 * MARGIN)
    assert family(z3) != family(z3_ac) and family(z3) == family(_c(3, micro_batch=4))


def test_without_a_cap_or_from_a_failed_trial_nothing_is_learned_or_skipped() -> None:
    cal = Calibration(cap=None)
    cal.learn(_trial(_c(2), OK, 300, 100))
    assert cal.ratio(_c(2)) == 3.0 and not cal.rules_out(_c(2), 10**12)
    capped = Calibration(cap=100)
    capped.learn(_trial(_c(2), "error: ValueError: bad", 1, 100))  # an error measured nothing
    assert capped.ratio(_c(2)) is None


def test_a_confirmed_trial_is_ranked_by_both_runs_and_a_second_run_over_the_cap_does_not_fit() -> None:
    c = Candidate(stage=2, micro_batch=2, accumulation=2)
    first = _trial(c, OK, 90, 80, step_s=1.0)
    first.step_times, first.wall_s = [1.0], 3.0
    again = _trial(c, OK, 95, None, step_s=3.0)  # type: ignore[arg-type]
    again.step_times, again.wall_s = [3.0], 4.0
    both = combine(first, again)
    assert both.step_s == 2.0 and both.samples_per_s == pytest.approx(4.0) and both.runs == 2
    assert both.peak_bytes == 95 and both.predicted_bytes == 80 and both.step_times == [1.0, 3.0]
    assert both.wall_s == 7.0
    over = combine(first, _trial(c, OVER_CAP, 120, 80))
    assert not over.fits and over.status == OVER_CAP and over.predicted_bytes == 80


def _fake_peak(profile: Any, c: Candidate, *args: Any) -> int:
    return {0: 60, 2: 40, 3: 30}[c.stage] * MIB * c.micro_batch


def _fake_trial(runs: list[str], setup: Any, c: Candidate) -> TrialResult:
    runs.append(c.name)
    peak = int(_fake_peak(None, c) * 1.5)  # every trial holds 1.5x the prediction
    if peak > setup.cap_bytes:
        return TrialResult(c, OVER_CAP, peak_bytes=peak)
    step = {0: 1.0, 2: 1.1, 3: 1.2}[c.stage] / c.micro_batch**0.5
    return TrialResult(c, OK, step_s=step, samples_per_s=8 / step, peak_bytes=peak)


def _tune_with_fake_trials(rank: int, world: int, tmp: str) -> dict[str, Any]:
    runs: list[str] = []
    config = {
        "train_batch_size": 8 * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {
            "tuner_type": "gridsearch",
            "tuner_early_stopping": 100,
            "num_tuning_micro_batch_sizes": 4,
            "max_memory_per_rank": 128 * MIB,  # 1.5x: z0 fits at micro batch 1, z2 at 2, z3 at 2
            "results_dir": f"{tmp}/r",
            "exps_dir": f"{tmp}/e",
        },
    }
    space = SearchSpace(stages=(0, 2, 3), offload_optimizer=("none",), activation_checkpointing=(False,))
    with (
        mock.patch.object(tune_module, "predict_peak", _fake_peak),
        mock.patch.object(tune_module, "run_trial", lambda setup, c: _fake_trial(runs, setup, c)),
        mock.patch.object(tune_module, "warm_up", lambda *a: None),
    ):
        result = tune_module.autotune(lambda: Net(32, 2), torch.randn(32, 32), config, space=space, verbose=False)
    return {
        "trials": [(t.candidate.name, t.status, t.runs) for t in result.trials],
        "runs": runs,
        "summary": {k: result.summary[k] for k in ("confirmed", "pruned_calibrated")},
    }


def test_a_tune_skips_what_the_measured_floor_rules_out_and_confirms_the_best_two(tmp_path: Path) -> None:
    out = run_distributed(_tune_with_fake_trials, world_size=2, args=(str(tmp_path),))
    assert out[0] == out[1]
    trials, runs = out[0]["trials"], out[0]["runs"]
    by_status: dict[str, list[str]] = {}
    for name, status, _ in trials:
        by_status.setdefault(status, []).append(name)
    # Predicted under the cap (120 MiB < 128) but 1.5x over it: once the first trial measured 1.5x, they are
    # skipped unrun.
    assert set(by_status[CALIBRATED]) == {"z0_mb2", "z3_mb4"}, by_status
    assert not set(by_status[CALIBRATED]) & set(runs)
    fitted = [(name, n) for name, status, n in trials if status == OK]
    assert [n for _, n in fitted[:2]] == [2, 2] and all(n == 1 for _, n in fitted[2:])
    assert runs.count(fitted[0][0]) == 2 and runs.count(fitted[2][0]) == 1
    assert out[0]["summary"] == {"confirmed": 2, "pruned_calibrated": 2}


def test_the_prediction_keeps_a_partial_offload_of_the_base_config_on_the_device() -> None:
    """``offload_optimizer.ratio`` in the base config: an offloading candidate keeps 1 - ratio of the masters
    and optimizer state on the device (runtime/memory.py ``offload_ratio``); without offload it changes nothing."""
    from ds_strategy.autotuning.profile import ModelProfile

    profile = ModelProfile(10**6, 10**6, 4, 10**5, 1000, 500, 1e6)
    cuda = torch.device("cuda")  # only its type is read: the device-side peak
    offloading, plain = (
        _c(2, offload_optimizer="cpu", micro_batch=2, accumulation=4),
        _c(2, micro_batch=2, accumulation=4),
    )

    def peak(c: Candidate, ratio: float | None) -> int:
        zero = {"offload_optimizer": {"device": "cpu", **({} if ratio is None else {"ratio": ratio})}}
        return tune_module.predict_peak(profile, c, 2, "bf16", "adam", cuda, {"zero_optimization": zero})

    full, half = peak(offloading, None), peak(offloading, 0.5)
    # fp32 master 4 B + Adam 8 B per element, this rank's half of 1e6 elements, half of that on the device
    assert half - full == int(0.5 * 12 * 10**6 / 2)
    assert peak(plain, None) == peak(plain, 0.5)
