"""The base of the optimizers ds_strategy creates: ``torch.optim.Optimizer`` without its torch._dynamo import.

[Note: torch._dynamo stays unimported]
``torch.optim.Optimizer`` wraps ``add_param_group``, ``state_dict``, ``load_state_dict`` and ``zero_grad`` in
``torch._disable_dynamo``, which imports torch._dynamo (with sympy, torch.fx and the rest) on the first
call: measured, constructing any torch optimizer takes a process from 218 to 290 MiB RSS, and under NVMe
offload that is a sixth of a rank's peak (bench_nvme's 8-layer GPT: 470 -> 400 MiB per rank without it).
The decorator matters only where torch.compile traces the call; constructing an optimizer and reading or
loading its state for a checkpoint happen outside any compiled region, so the optimizers ds_strategy
creates call those three undecorated (``__wrapped__``, which ``functools.wraps`` sets), with torch's own
logic unchanged. ``zero_grad`` keeps the decorator (a compiled training step may call it). A user's torch
optimizer, or torch.compile itself, imports torch._dynamo as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer


def _undecorated(method: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(method, "__wrapped__", method)


class OptimizerBase(Optimizer):
    """``torch.optim.Optimizer`` whose construction and checkpoint methods leave torch._dynamo unimported."""

    @staticmethod
    def _closure_loss(closure: Callable[[], float] | None) -> float | None:
        """``step(closure)``'s loss: the closure re-evaluated with grad enabled (steps run under no_grad)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _undecorated(Optimizer.add_param_group)(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _undecorated(Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _undecorated(Optimizer.load_state_dict)(self, state_dict)
