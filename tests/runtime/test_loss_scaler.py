"""LossScaler: DeepSpeed's dynamic rule (hysteresis, window, consecutive hysteresis, minimum)."""

from __future__ import annotations

import pytest

from ds_strategy.config import FP16Config
from ds_strategy.runtime.loss_scaler import LossScaleError, LossScaler


def _run(scaler: LossScaler, overflows: str) -> list[float]:
    """Feed a pattern ('x' overflow, '.' clean step); return the scale after each step."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.loss_scale)
    return out


def test_from_config_dynamic_and_static() -> None:
    dyn = LossScaler.from_config(FP16Config(enabled=True, initial_scale_power=5, loss_scale_window=7, hysteresis=3))
    assert dyn.dynamic and dyn.loss_scale == 32 and dyn.scale_window == 7 and dyn.hysteresis == 3
    static = LossScaler.from_config(FP16Config(enabled=True, loss_scale=128.0))
    assert not static.dynamic and static.loss_scale == 128
    assert _run(static, "xx....x") == [128.0] * 7


def test_scale_halves_after_hysteresis_overflows() -> None:
    scaler = LossScaler(init_scale=1024, dynamic=True, scale_window=100, hysteresis=2)
    # first overflow spends hysteresis, the second halves; the budget is not refilled by a decrease
    assert _run(scaler, "xx") == [1024, 512]
    assert _run(scaler, "x") == [256]


def test_scale_grows_after_window_clean_steps_and_refills_hysteresis() -> None:
    scaler = LossScaler(init_scale=64, dynamic=True, scale_window=4, hysteresis=2)
    assert _run(scaler, "...") == [64, 64, 64]
    assert _run(scaler, ".") == [128]  # 4 clean steps since the start
    assert _run(scaler, "x") == [128]  # hysteresis 2 -> 1
    assert _run(scaler, "....") == [128, 128, 128, 256]  # window counted from the overflow; budget refilled
    assert _run(scaler, "x") == [256]  # so this overflow is absorbed again


def test_consecutive_hysteresis_refills_after_every_clean_step() -> None:
    scaler = LossScaler(init_scale=64, dynamic=True, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    assert _run(scaler, "x.x.x.") == [64] * 6  # never two overflows in a row
    assert _run(scaler, "xx") == [64, 32]


def test_never_below_minimum_and_error_when_stuck_there() -> None:
    scaler = LossScaler(init_scale=8, dynamic=True, scale_window=100, hysteresis=1, min_scale=2)
    assert _run(scaler, "xx") == [4, 2]
    with pytest.raises(LossScaleError, match="min_loss_scale=2"):
        scaler.update(True)


def test_state_round_trip() -> None:
    a = LossScaler(init_scale=64, dynamic=True, scale_window=3, hysteresis=2)
    _run(a, "x..")
    b = LossScaler(init_scale=1, dynamic=True, scale_window=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert _run(a, ".x.x..") == _run(b, ".x.x..")


def test_invalid_settings() -> None:
    with pytest.raises(ValueError, match="loss scale must be > 0"):
        LossScaler(init_scale=0)
    with pytest.raises(ValueError, match="hysteresis >= 1"):
        LossScaler(init_scale=1, dynamic=True, hysteresis=0)
