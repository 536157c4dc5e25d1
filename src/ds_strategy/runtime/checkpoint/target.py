"""What checkpointing needs from the thing it saves: a narrow, typed contract instead of the engine itself.

``ZeroEngine`` satisfies ``CheckpointTarget`` structurally; runtime/checkpoint imports nothing above it
(anchor: torchtitan's checkpoint manager, which receives stateful components, not the trainer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..counters import StepCounters
from ..zero.buffers import GroupStorage
from ..zero.collectives import Collectives
from ..zero.per_tensor import WholeTensors


class StatefulScaler(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PartitionedState(Protocol):
    """The ZeRO stage as checkpoints see it: its param groups' layouts and masters, and how to make the
    parameters follow masters that were overwritten."""

    @property
    def stage(self) -> int: ...

    @property
    def groups(self) -> Sequence[GroupStorage]: ...

    @property
    def whole(self) -> WholeTensors | None:
        """A per-tensor optimizer's tensors (their state is saved by name), else None."""

    def publish(self) -> None:
        """Masters -> compute-dtype parameters (and, partitioned, the gathered copies)."""

    def zero_grad(self) -> None: ...

    @property
    def placement(self) -> ParameterPlacement: ...


class ParameterPlacement(Protocol):
    """Where the stage's parameters live (runtime/zero/placement.py), as checkpoints see it."""

    def refresh_frozen(self) -> None:
        """After frozen partitions were overwritten: bring their gathered copies up to date (stage 3)."""


class CheckpointTarget(Protocol):
    @property
    def module(self) -> nn.Module: ...

    @property
    def stage(self) -> PartitionedState: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def lr_scheduler(self) -> Any: ...

    @property
    def loss_scaler(self) -> StatefulScaler: ...

    @property
    def counters(self) -> StepCounters: ...

    @property
    def coll(self) -> Collectives: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def tag_validation(self) -> str:
        """``checkpoint.tag_validation``: "Warn", "Ignore" or "Fail"."""

    @property
    def mid_accumulation(self) -> bool:
        """Gradients of an unfinished accumulation window exist (they are not saved)."""
