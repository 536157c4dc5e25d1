"""ds_strategy for PyTorch Lightning: ``ZeroStrategy``, its precision plugin and the strategy names.

Importing this package registers ``zero0``, ``zero1``, ``zero1_offload``, ``zero2``, ``zero2_offload``,
``zero3`` and ``zero3_offload`` with Lightning's ``StrategyRegistry`` (idempotent), so
``Trainer(strategy="zero2")`` works. See docs/lightning.md.
"""

from __future__ import annotations

from .precision import ZeroPrecision
from .registry import STRATEGY_NAMES, register_strategies
from .strategy import ZeroStrategy

register_strategies()

__all__ = [
    "STRATEGY_NAMES",
    "ZeroPrecision",
    "ZeroStrategy",
    "register_strategies",
]
