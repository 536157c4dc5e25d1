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
    assert _run(scaler, "....") == [64, 64, 64, 64]
    assert _run(scaler, ".") == [128]  # 5 clean steps since the start (DeepSpeed's count: window + 1)
    assert _run(scaler, "...") == [128, 128, 128]
    assert _run(scaler, ".") == [256]  # then every window
    assert _run(scaler, "x") == [256]  # hysteresis 2 -> 1
    assert _run(scaler, ".....") == [256, 256, 256, 256, 512]  # window + 1 counted from the overflow; refilled
    assert _run(scaler, "x") == [512]  # so this overflow is absorbed again


PATTERNS = ["." * 12, "..x......x.x.....", "xx....x..........x", "x.x.x.x....", "...xx.xx.........."]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_scale_trajectory_equals_deepspeeds(pattern: str, consecutive: bool) -> None:
    """The scale after every step, against DeepSpeed 0.19.8's own DynamicLossScaler (where installed;
    the patterns above are also pinned by the tests before this one)."""
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    import deepspeed.comm

    kw = {"scale_window": 3, "min_scale": 1.0, "consecutive_hysteresis": consecutive}
    theirs = loss_scaler.DynamicLossScaler(init_scale=64.0, delayed_shift=2, **kw)
    ours = LossScaler(init_scale=64, dynamic=True, hysteresis=2, **kw)
    real_rank = deepspeed.comm.get_rank
    loss_scaler.dist.get_rank = lambda *a, **k: 0  # its overflow log asks for a rank; no process group here
    try:
        want = []
        for c in pattern:
            theirs.update_scale(c == "x")
            want.append(theirs.cur_scale)
    finally:
        loss_scaler.dist.get_rank = real_rank
    assert _run(ours, pattern) == want


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
