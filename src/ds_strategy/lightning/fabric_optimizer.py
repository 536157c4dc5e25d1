"""``EngineOptimizer``: the optimizer ``fabric.setup`` hands back, tied to its engine.

Fabric wraps whatever the strategy returns in its ``_FabricOptimizer`` and calls the optimizer's own
``zero_grad``. Under ZeRO the gradients live in the engine's buffers, not in ``p.grad`` of the optimizer's
(master) parameters, so ``zero_grad`` must reach the engine: a GAN's generator loss back-propagates through
the discriminator, and ``opt_d.zero_grad()`` has to drop those gradients before the discriminator's own
backward, as it does under DDP. Everything else (param groups, state, hyperparameters) is the client
optimizer's, rewired by the engine onto its fp32 masters: a scheduler built on either object steps the same
group dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine


class EngineOptimizer(Optimizer):
    """``engine.optimizer`` whose ``step``/``zero_grad`` are the engine's (an ``Optimizer`` for isinstance
    checks such as torch's LR schedulers; its containers are the engine optimizer's, never copies)."""

    def __init__(self, engine: ZeroEngine) -> None:  # no Optimizer.__init__: nothing of its own to hold
        if engine.optimizer is None:
            raise ValueError("EngineOptimizer needs an engine built with an optimizer")
        self._zero_engine = engine

    @property
    def engine(self) -> ZeroEngine:
        return self._zero_engine

    @property
    def inner(self) -> Optimizer:
        optimizer = self._zero_engine.optimizer
        assert optimizer is not None
        return optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_engine.zero_grad()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise TypeError("a ZeRO engine's optimizer step takes no closure (it would re-run backward)")
        self._zero_engine.step()

    def state_dict(self) -> dict[str, Any]:
        """This rank's partition of the optimizer state (``fabric.save`` writes every rank's, resharded on load)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.inner!r})"
