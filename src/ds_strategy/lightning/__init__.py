"""ds_strategy for PyTorch Lightning: ``ZeroStrategy`` (Trainer), ``ZeroFabricStrategy`` (Fabric), their
precision plugins, the strategy names and ``ZeroTuner`` (the autotuner before ``Trainer.fit``).

Importing this package registers ``zero0``, ``zero1``, ``zero1_offload``, ``zero2``, ``zero2_offload``,
``zero3``, ``zero3_offload`` and ``zero3_offload_nvme`` with the Trainer's ``StrategyRegistry`` and with
Fabric's ``STRATEGY_REGISTRY`` (idempotent), so ``Trainer(strategy="zero2")`` and
``Fabric(strategy="zero3")`` work. See docs/lightning.md and docs/fabric.md.
"""

from __future__ import annotations

from .fabric_optimizer import EngineOptimizer
from .fabric_precision import ZeroFabricPrecision
from .fabric_strategy import ZeroFabricStrategy
from .precision import ZeroPrecision
from .registry import STRATEGY_NAMES, register_fabric_strategies, register_strategies
from .strategy import ZeroStrategy
from .tuner import ZeroTuner

register_strategies()
register_fabric_strategies()

__all__ = [
    "STRATEGY_NAMES",
    "EngineOptimizer",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "ZeroTuner",
    "register_fabric_strategies",
    "register_strategies",
]
