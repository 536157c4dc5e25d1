"""The lowercase strategy names: ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")``.

``register_strategies`` is idempotent: registering again (a second import, a module reload) replaces our
own entries, but a name some other library registered first is never taken over silently.
"""

from __future__ import annotations

from typing import Any

# name -> (description, ZeroStrategy keyword arguments)
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "zero0": ("ds_strategy ZeRO stage 0 (replicated, bucketed all-reduce)", {"stage": 0}),
    "zero1": ("ds_strategy ZeRO stage 1 (optimizer state partitioned)", {"stage": 1}),
    "zero1_offload": ("ds_strategy ZeRO stage 1, optimizer offloaded to CPU", {"stage": 1, "offload_optimizer": True}),
    "zero2": ("ds_strategy ZeRO stage 2 (optimizer state and gradients partitioned)", {"stage": 2}),
    "zero2_offload": ("ds_strategy ZeRO stage 2, optimizer offloaded to CPU", {"stage": 2, "offload_optimizer": True}),
    "zero3": ("ds_strategy ZeRO stage 3 (parameters partitioned too)", {"stage": 3}),
    "zero3_offload": (
        "ds_strategy ZeRO stage 3, optimizer and parameters offloaded to CPU",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
    "zero3_offload_nvme": (
        "ds_strategy ZeRO stage 3, optimizer and parameters offloaded to NVMe under /local_nvme (ZeRO-Infinity)",
        {
            "stage": 3,
            "offload_optimizer": True,
            "offload_parameters": True,
            "offload_optimizer_device": "nvme",
            "offload_params_device": "nvme",
            "nvme_path": "/local_nvme",
        },
    ),
}


def register_strategies(registry: Any = None) -> list[str]:
    """Register the names in ``registry`` (Lightning's ``StrategyRegistry`` by default); return them."""
    from .strategy import ZeroStrategy

    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        registry = StrategyRegistry
    _register(registry, ZeroStrategy, "pass ZeroStrategy(...) to the Trainer instead")
    return list(STRATEGY_NAMES)


def register_fabric_strategies(registry: Any = None) -> list[str]:
    """The same names in Fabric's registry (``lightning.fabric.strategies.STRATEGY_REGISTRY`` by default):
    ``Fabric(strategy="zero3")`` builds a ``ZeroFabricStrategy``."""
    from .fabric_strategy import ZeroFabricStrategy

    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        registry = STRATEGY_REGISTRY
    _register(registry, ZeroFabricStrategy, "pass ZeroFabricStrategy(...) to Fabric instead")
    return list(STRATEGY_NAMES)


def _register(registry: Any, strategy: type, instead: str) -> None:
    ours = f"{strategy.__module__}.{strategy.__qualname__}"
    for name, (description, kwargs) in STRATEGY_NAMES.items():
        if name in registry:
            existing = registry[name]["strategy"]
            if f"{existing.__module__}.{existing.__qualname__}" != ours:
                raise ValueError(
                    f"strategy name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}; "
                    f"ds_strategy will not replace it ({instead})"
                )
        registry.register(name, strategy, description=description, override=True, **kwargs)
