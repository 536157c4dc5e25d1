"""DeepSpeed's lr schedules against their closed forms, step by step."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from ds_strategy.config import load_config
from ds_strategy.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def _opt(lr: float = 0.5, groups: int = 1) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]} for _ in range(groups)], lr=lr)


def _trajectory(schedule: object, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        schedule.step()  # type: ignore[attr-defined]
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _close(actual: list[float], expected: Callable[[int], float]) -> None:
    assert actual == pytest.approx([expected(i) for i in range(len(actual))], rel=1e-12, abs=1e-15)


def test_warmup_lr_log_and_linear() -> None:
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10)
    assert opt.param_groups[0]["lr"] == 0.01  # set at construction
    _close(_trajectory(sched, opt, 15), lambda i: 0.01 + 0.09 * (math.log(i + 1) / math.log(10) if i < 10 else 1))
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=4, warmup_type="linear")
    _close(_trajectory(sched, opt, 6), lambda i: 0.5 * min(i / 4, 1.0))  # max lr = the optimizer's lr
    assert sched.get_last_lr() == [0.5]


def test_warmup_decay_lr() -> None:
    opt = _opt()
    sched = WarmupDecayLR(
        opt, total_num_steps=20, warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=5, warmup_type="linear"
    )
    _close(_trajectory(sched, opt, 25), lambda i: 0.2 * (i / 5 if i < 5 else max(0.0, (20 - i) / 15)))


def test_warmup_cosine_lr() -> None:
    opt = _opt(lr=0.3, groups=2)
    sched = WarmupCosineLR(
        opt, total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=5, cos_min_ratio=0.01, warmup_type="linear"
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # every group starts at 0

    def ratio(i: int) -> float:
        if i < 5:
            return 0.1 + 0.9 * i / 5
        return max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * min(1.0, (i - 4) / 15))) / 2)

    lrs = _trajectory(sched, opt, 26)
    _close(lrs, lambda i: 0.3 * ratio(i))
    assert lrs[19:] == pytest.approx([0.3 * 0.01] * 7)  # held at the floor past total_num_steps, not back up
    assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("total", [4, 3], ids=["total-equals-warmup", "total-below-warmup"])
def test_warmup_cosine_lr_without_a_decay_window(total: int) -> None:
    """total_num_steps <= warmup_num_steps: the warmup, then the floor (no division by zero, no swing)."""
    opt = _opt(lr=1.0)
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_num_steps=4, cos_min_ratio=0.05, warmup_type="linear")
    _close(_trajectory(sched, opt, 9), lambda i: i / 4 if i < 4 else 0.05)


def test_one_cycle_lr_momentum_and_decay() -> None:
    opt = _opt()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        decay_lr_rate=0.5,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
    )
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.8, 0.99)  # DeepSpeed's beta2

    def scale(i: int) -> float:  # position in the triangle after step i (iteration i + 1)
        x = (i + 1) / 10
        return x / 0.4 if x <= 0.4 else (x - 1) / (0.4 - 1)

    lrs, moms = [], []
    for _ in range(14):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"])
    _close(lrs, lambda i: 0.01 + 0.09 * scale(i) if i < 10 else 0.01 / (1 + 0.5 * (i - 9) / 2))
    assert [m[0] for m in moms[:10]] == pytest.approx([0.9 - 0.1 * scale(i) for i in range(10)])
    assert all(m[1] == 0.99 for m in moms)  # DeepSpeed's OneCycle writes beta2 = 0.99 with every momentum


def test_one_cycle_stairs_per_group_momentum_and_bad_step_sizes() -> None:
    """cycle_*_stair_count: each half moves in whole stairs (DeepSpeed's trajectory for first step size 4,
    2 stairs); per-group momentum bounds; a step size of 0 is a clear error, not a ZeroDivisionError."""
    opt = _opt(groups=2)
    sched = OneCycle(
        opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4, cycle_first_stair_count=2,
        cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95],
    )  # fmt: skip
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    lrs = _trajectory(sched, opt, 8)
    _close(lrs, lambda i: [0.001, 0.0055, 0.0055, 0.01, 0.0055, 0.0055, 0.001, 0.001][i])
    sched = OneCycle(_opt(groups=2), cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4,
                     cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95])  # fmt: skip
    sched.step()
    assert [g["betas"][0] for g in sched.optimizer.param_groups] == pytest.approx([0.875, 0.925])
    with pytest.raises(ValueError, match="cycle_first_step_size must be positive, got 0"):
        OneCycle(_opt(), cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=0)
    with pytest.raises(ValueError, match="cycle_min_mom has 3 values but the optimizer has 1 param groups"):
        OneCycle(_opt(), cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_min_mom=[0.8, 0.8, 0.8])


def test_lr_range_test_continuous_and_staircase() -> None:
    opt = _opt()
    sched = LRRangeTest(opt, lr_range_test_min_lr=1e-3, lr_range_test_step_size=5, lr_range_test_step_rate=2.0)
    assert opt.param_groups[0]["lr"] == 1e-3
    _close(_trajectory(sched, opt, 12), lambda i: 1e-3 * (1 + 2 * (i + 1) / 5))  # step i is iteration i
    opt = _opt()
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size=5,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=True,
    )
    _close(_trajectory(sched, opt, 12), lambda i: 1e-3 * (1 + 2 * ((i + 1) // 5)))


def test_per_group_values_resume_and_errors() -> None:
    opt = _opt(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=2, warmup_type="linear")
    sched.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])
    resumed = WarmupLR(
        _opt(groups=2),
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.2],
        warmup_num_steps=2,
        warmup_type="linear",
        last_batch_iteration=5,
    )
    resumed.load_state_dict(sched.state_dict())
    assert resumed.last_batch_iteration == 1
    with pytest.raises(ValueError, match="2 param groups"):
        WarmupLR(_opt(groups=2), warmup_min_lr=[0.0, 0.1, 0.2])
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_opt(), warmup_type="cubic")


def test_built_from_the_config() -> None:
    cfg = load_config(
        {
            "train_batch_size": 4,
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "total_num_steps": 10,
                    "warmup_max_lr": 0.05,
                    "warmup_num_steps": 2,
                    "warmup_type": "linear",
                },
            },
        },
        world_size=1,
    )
    assert cfg.scheduler is not None
    opt = _opt()
    sched = build_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupDecayLR)
    _close(_trajectory(sched, opt, 4), lambda i: 0.05 * (i / 2 if i < 2 else (10 - i) / 8))
