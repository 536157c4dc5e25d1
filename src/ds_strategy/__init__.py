"""ds_strategy: DeepSpeed-class ZeRO training for PyTorch Lightning and plain PyTorch loops.

``import ds_strategy`` registers the Lightning strategy names (zero0 ... zero3_offload, see
``ds_strategy.lightning``) and initialises no CUDA context; everything else is resolved on first attribute
access (PEP 562), from the submodule listed in ``_LAZY``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ds_strategy.lightning import ZeroPrecision, ZeroStrategy  # importing registers zero0 ... zero3_offload

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "get_accelerator": "ds_strategy.accelerator",
    "init_distributed": "ds_strategy.comm",
    "initialize": "ds_strategy.runtime",
    "ZeroEngine": "ds_strategy.runtime",
    "estimate_memory": "ds_strategy.runtime",
}

__all__ = ["ZeroPrecision", "ZeroStrategy", "__version__", *_LAZY]

if TYPE_CHECKING:
    from ds_strategy.accelerator import get_accelerator as get_accelerator
    from ds_strategy.comm import init_distributed as init_distributed
    from ds_strategy.runtime import ZeroEngine as ZeroEngine
    from ds_strategy.runtime import estimate_memory as estimate_memory
    from ds_strategy.runtime import initialize as initialize  # type: ignore[no-redef]  # also a submodule name


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_strategy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
