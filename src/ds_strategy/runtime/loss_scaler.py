"""fp16 loss scaling with DeepSpeed's semantics: static, or dynamic with hysteresis.

Dynamic rule (DeepSpeed's ``DynamicLossScaler.update_scale``), applied once per optimizer step after
the ranks have agreed whether any gradient overflowed:

- overflow: if the hysteresis budget is down to 1 (or ``hysteresis`` is 1) the scale is divided by 2
  (never below ``min_loss_scale``); otherwise one unit of hysteresis is spent and the scale is kept.
- no overflow: with ``consecutive_hysteresis`` the budget refills after every clean step; the scale
  doubles after ``loss_scale_window`` + 1 clean steps since the last overflow (or the start), then every
  ``loss_scale_window`` clean steps (DeepSpeed 0.19's count), which also refills the budget when
  ``consecutive_hysteresis`` is off.

The overflowing step itself is always skipped by the engine (static scales included).

[Note: overflow at the minimum scale]
A scale that cannot go down any further cannot cure an overflow, and skipping every step would train
nothing while looking alive. So when an overflow arrives that would lower the scale (hysteresis spent)
while the scale already equals ``min_loss_scale``, ``update`` raises ``LossScaleError`` - DeepSpeed's
``raise_error_at_min_scale`` behaviour. With the default hysteresis of 2 that means the run stops at the
second overflow seen at the minimum scale (hysteresis is not refilled by a scale decrease), never at a
single isolated one reached on the way down.
"""

from __future__ import annotations

from typing import Any

from ds_strategy.config import FP16Config


class LossScaleError(RuntimeError):
    """fp16 gradients keep overflowing although the loss scale is already at its minimum."""


class LossScaler:
    """Current loss scale and its update rule; ``dynamic=False`` keeps ``init_scale`` forever."""

    def __init__(
        self,
        *,
        init_scale: float = 1.0,
        dynamic: bool = False,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
    ) -> None:
        if init_scale <= 0:
            raise ValueError(f"the loss scale must be > 0, got {init_scale}")
        if dynamic and (scale_window < 1 or hysteresis < 1 or min_scale <= 0 or scale_factor <= 1):
            raise ValueError(
                f"dynamic loss scaling needs loss_scale_window >= 1 (got {scale_window}), hysteresis >= 1 "
                f"(got {hysteresis}), min_loss_scale > 0 (got {min_scale}) and a factor > 1 (got {scale_factor})"
            )
        self.dynamic = dynamic
        self.cur_scale = float(init_scale)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, fp16: FP16Config) -> LossScaler:
        """The scaler an fp16 config asks for (``loss_scale`` 0 = dynamic from 2**initial_scale_power)."""
        return cls(
            init_scale=fp16.initial_scale,
            dynamic=fp16.dynamic_loss_scale,
            scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale,
        )

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; raises ``LossScaleError`` per [Note: overflow at the minimum scale]."""
        if not self.dynamic:
            self.cur_iter += 1
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale <= self.min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflowed at step {self.cur_iter} although the loss scale is already at "
                        f"min_loss_scale={self.min_scale:g} and the hysteresis ({self.hysteresis}) is spent. The "
                        "loss or the gradients are inf/nan on their own: lower the learning rate, clip gradients "
                        "(gradient_clipping), check the data, or train in bf16 instead of fp16."
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # DeepSpeed's count: the step right after an overflow (or the first step) is interval 0, so the
            # first doubling comes after loss_scale_window + 1 clean steps, the next ones every window.
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "cur_scale": self.cur_scale,
            "cur_hysteresis": self.cur_hysteresis,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.cur_scale:g}, hysteresis={self.cur_hysteresis}/{self.hysteresis})"
