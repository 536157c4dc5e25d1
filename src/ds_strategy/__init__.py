"""ds_strategy: DeepSpeed-class ZeRO training for PyTorch Lightning and plain PyTorch loops.

``import ds_strategy`` stays light (no torch, no Lightning, no CUDA) and still makes ``Trainer(strategy=
"zero3")`` work: the strategy names (zero0 ... zero3_offload) are registered when Lightning is imported
(see ``ds_strategy._lightning_hook``). Public names are resolved on first attribute access (PEP 562),
from the submodule listed in ``_LAZY``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ds_strategy import _lightning_hook
from ds_strategy._version import __version__

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "ZeroStrategy": "ds_strategy.lightning",
    "ZeroPrecision": "ds_strategy.lightning",
    "ZeroTuner": "ds_strategy.lightning",
    "autotune": "ds_strategy.autotuning",
    "get_accelerator": "ds_strategy.accelerator",
    "init_distributed": "ds_strategy.comm",
    "initialize": "ds_strategy.runtime",
    "ZeroEngine": "ds_strategy.runtime",
    "MuonWithAuxAdam": "ds_strategy.runtime",
    "estimate_memory": "ds_strategy.runtime",
    "estimate_zero2_model_states_mem_needs": "ds_strategy.runtime",
    "estimate_zero2_model_states_mem_needs_all_live": "ds_strategy.runtime",
    "estimate_zero3_model_states_mem_needs": "ds_strategy.runtime",
    "estimate_zero3_model_states_mem_needs_all_live": "ds_strategy.runtime",
    "IgnoredConfigWarning": "ds_strategy.config",
}

# submodules users reach as attributes: ds_strategy.zero.Init(...), ds_strategy.ops.CPUAdam(...)
_SUBMODULES = ("zero", "pipe", "checkpointing", "sequence", "ops", "comm", "config", "lightning", "runtime")

__all__ = ["__version__", *_LAZY, *_SUBMODULES]

if TYPE_CHECKING:
    from ds_strategy.accelerator import get_accelerator as get_accelerator
    from ds_strategy.autotuning import autotune as autotune
    from ds_strategy.comm import init_distributed as init_distributed
    from ds_strategy.config import IgnoredConfigWarning as IgnoredConfigWarning
    from ds_strategy.lightning import ZeroPrecision as ZeroPrecision
    from ds_strategy.lightning import ZeroStrategy as ZeroStrategy
    from ds_strategy.lightning import ZeroTuner as ZeroTuner
    from ds_strategy.runtime import MuonWithAuxAdam as MuonWithAuxAdam
    from ds_strategy.runtime import ZeroEngine as ZeroEngine
    from ds_strategy.runtime import estimate_memory as estimate_memory
    from ds_strategy.runtime import estimate_zero2_model_states_mem_needs as estimate_zero2_model_states_mem_needs
    from ds_strategy.runtime import (
        estimate_zero2_model_states_mem_needs_all_live as estimate_zero2_model_states_mem_needs_all_live,
    )
    from ds_strategy.runtime import estimate_zero3_model_states_mem_needs as estimate_zero3_model_states_mem_needs
    from ds_strategy.runtime import (
        estimate_zero3_model_states_mem_needs_all_live as estimate_zero3_model_states_mem_needs_all_live,
    )
    from ds_strategy.runtime import initialize as initialize  # type: ignore[no-redef]  # also a submodule name


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"ds_strategy.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_strategy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


_lightning_hook.install()
