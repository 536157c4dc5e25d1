"""The engine's step counters, one object that saves and restores itself (checkpoints read it, never the
engine's attributes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class StepCounters:
    """DeepSpeed's counters: ``micro_steps`` counts every ``engine.step()`` call, ``global_steps`` every
    accumulation boundary (applied or skipped), ``skipped_steps`` the boundaries an overflow skipped,
    ``global_samples`` the samples of the boundaries so far.

    A bf16/fp32 step skips an inf/nan gradient on the device (docs/zero3.md, "No host synchronisation in a
    step"): its flag is added to ``pending_skips`` (a device tensor) and counted into ``skipped_steps`` only
    when someone asks (``settle``: the engine's ``skipped_steps``, a checkpoint)."""

    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    pending_skips: Any = field(default=None, repr=False, compare=False)  # a device tensor, or None

    def add_device_skip(self, flag: Any) -> None:
        """Count a step skipped where ``flag`` (a 0-dim device tensor, 1.0 or 0.0) says so, without reading it."""
        self.pending_skips = flag.double() if self.pending_skips is None else self.pending_skips + flag

    def settle(self) -> None:
        """Read the device-side skips into ``skipped_steps`` (one host read, when asked)."""
        if self.pending_skips is not None:
            pending, self.pending_skips = self.pending_skips, None
            self.skipped_steps += round(float(pending))

    def state_dict(self) -> dict[str, int]:
        self.settle()
        return {name: getattr(self, name) for name in _SAVED}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        missing = [name for name in _SAVED if name not in state]
        if missing:
            raise KeyError(f"step counters: the saved state lacks {missing}")
        for name in _SAVED:
            setattr(self, name, int(state[name]))
        self.pending_skips = None


_SAVED = tuple(f.name for f in fields(StepCounters) if f.name != "pending_skips")
