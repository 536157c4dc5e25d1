"""The engine's step counters, one object that saves and restores itself (checkpoints read it, never the
engine's attributes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields


@dataclass
class StepCounters:
    """DeepSpeed's counters: ``micro_steps`` counts every ``engine.step()`` call, ``global_steps`` every
    accumulation boundary (applied or skipped), ``skipped_steps`` the boundaries an fp16 overflow skipped,
    ``global_samples`` the samples of the boundaries so far."""

    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        missing = [f.name for f in fields(self) if f.name not in state]
        if missing:
            raise KeyError(f"step counters: the saved state lacks {missing}")
        for f in fields(self):
            setattr(self, f.name, int(state[f.name]))
