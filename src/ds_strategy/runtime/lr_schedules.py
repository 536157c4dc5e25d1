"""DeepSpeed's learning-rate schedules, stepped by the engine once per applied optimizer step.

Same constructors, defaults and step arithmetic as ``deepspeed.runtime.lr_schedules`` (the iteration
counter is ``last_batch_iteration``, -1 before the first ``step()``), written from their documented
formulas. Deliberate differences, each a fix of something that cannot be intended:

- ``WarmupLR`` with ``warmup_max_lr=None`` uses each param group's own lr (DeepSpeed takes group 0's).
- ``WarmupCosineLR`` sets *every* group's lr to 0 before the first step (DeepSpeed only group 0).
- ``OneCycle`` momentum cycling replaces beta1 and keeps each group's beta2 (DeepSpeed forces 0.99).
- ``OneCycle`` accepts the stair counts and, like DeepSpeed, does not use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from ds_strategy.config import SchedulerConfig
from ds_strategy.log import get_logger

log = get_logger(__name__)

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _per_group(value: float | Sequence[float], optimizer: Optimizer, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups  # type: ignore[arg-type]  # a number here


class _Schedule:
    """Shared state: the optimizer, the iteration counter and the last lrs written."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write(self.get_lr())

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr() needs a step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])

    def _write(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return warmup_type


class WarmupLR(_Schedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold it.

    lr(i) = min + (max - min) * gamma(i), gamma = log(i + 1) / log(N) ("log") or i / N ("linear") for
    i < N, else 1; N = max(2, warmup_num_steps).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, optimizer, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, optimizer, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._write(self.min_lrs)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay to 0 at ``total_num_steps``:
    gamma(i) = max(0, (T - i) / max(1, T - N)) for i >= N."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's initial lr: warmup from ``warmup_min_ratio`` to 1 over N steps, then a cosine
    decay to ``cos_min_ratio`` at ``total_num_steps``, held there after it:
    ratio(i) = c + (1 - c) * (1 + cos(pi * min(1, (i - N + 1) / max(1, T - N)))) / 2 for i >= N, floored at 0."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            ratio = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        # Past total_num_steps (or with no decay window, T <= N) the ratio stays at the floor: an
        # undercounted total must not send the lr back up.
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """One triangular cycle of the lr between ``cycle_min_lr`` and ``cycle_max_lr`` (and of beta1 between
    ``cycle_max_mom`` and ``cycle_min_mom``, inversely), then a decay of the lr by
    ``1 / (1 + decay_lr_rate * k / decay_step_size)`` k steps after the cycle. ``cycle_*_stair_count`` > 0
    moves each half of the cycle in that many equal stairs instead of linearly. Every lr and momentum bound
    may be a list with one value per param group. As in DeepSpeed, cycling the momentum writes each group's
    ``betas`` as ``(beta1, 0.99)``."""

    BETA2 = 0.99  # DeepSpeed's OneCycle writes this second beta with every momentum

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"OneCycle: cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"OneCycle: cycle_second_step_size must be >= 0, got {cycle_second_step_size}")
        self.first_size, self.second_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(cycle_min_lr, optimizer, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, optimizer, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.warning("OneCycle: cycle_momentum is off because %s has no betas", type(optimizer).__name__)
        self.min_moms = _per_group(cycle_min_mom, optimizer, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, optimizer, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        if last_batch_iteration == -1:
            self._write(self.min_lrs)
            if self.cycle_momentum:
                self._write_beta1(self.min_moms)

    def _scale_factor(self) -> float:
        iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        rising = x <= self.step_ratio
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:  # the position within the half, rounded down to a whole stair
            at = iteration % self.total_size
            if at <= self.first_size:
                position = at * stairs / self.first_size
            else:
                position = (self.total_size - at) * stairs / self.second_size
            return math.floor(position) / stairs
        return x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [hi * (1 + self.decay_mom_rate * interval) for hi in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._write_beta1(moms)

    def _write_beta1(self, moms: Sequence[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms, strict=True):
            group["betas"] = (mom, self.BETA2)


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr``: after the step of iteration i (the (i + 1)-th step),
    lr = min * (1 + rate * (i + 1) / step_size), with ``floor((i + 1) / step_size)`` instead when
    ``lr_range_test_staircase``; ``min`` until the first step."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group(lr_range_test_min_lr, optimizer, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._write(self.min_lrs)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lrs]


SCHEDULES: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(config: SchedulerConfig, optimizer: Optimizer) -> _Schedule:
    """The schedule a config's ``scheduler`` block names, on ``optimizer``."""
    cls = SCHEDULES.get(config.type)
    if cls is None:
        raise ValueError(f"unknown scheduler type {config.type!r}; expected one of {', '.join(SCHEDULES)}")
    return cls(optimizer, **config.kwargs())
