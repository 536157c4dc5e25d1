"""``get_accelerator()``: the device kind this process runs on, as a small immutable object.

    from ds_strategy import get_accelerator

    acc = get_accelerator()                 # CudaAccelerator | CpuAccelerator | MpsAccelerator
    acc.device_type                         # "cuda" | "cpu" | "mps"
    acc.communication_backend_name()        # "nccl" on CUDA, "gloo" otherwise
    acc.memory_stats().describe()           # device allocated + peak; process RSS + peak RSS on CPU
    acc.synchronize(); acc.manual_seed(0)

Selection: ``get_accelerator(name)`` if a name is given; else the ``DS_ACCELERATOR`` environment
variable (``cuda`` | ``cpu`` | ``mps``); else autodetection: CUDA when torch sees a CUDA device, then
MPS, then CPU. Neither importing this package nor selecting an accelerator initialises CUDA (see
[Note: never initialise CUDA early] in base.py). The objects are stateless and cached per kind.
"""

from __future__ import annotations

import functools

from ds_strategy import env
from ds_strategy.accelerator import strict
from ds_strategy.accelerator.base import Accelerator, MemoryStats
from ds_strategy.accelerator.cpu import CpuAccelerator
from ds_strategy.accelerator.cuda import CudaAccelerator
from ds_strategy.accelerator.mps import MpsAccelerator

ACCELERATOR_ENV = env.ACCELERATOR
_KINDS: dict[str, type[Accelerator]] = {"cuda": CudaAccelerator, "cpu": CpuAccelerator, "mps": MpsAccelerator}
VALID_ACCELERATORS: tuple[str, ...] = tuple(_KINDS)

__all__ = [
    "ACCELERATOR_ENV",
    "VALID_ACCELERATORS",
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "MemoryStats",
    "MpsAccelerator",
    "detect_accelerator",
    "get_accelerator",
]


def get_accelerator(name: str | None = None) -> Accelerator:
    """The accelerator named by ``name``, else by ``$DS_ACCELERATOR``, else the detected one.

    Raises ValueError for a name outside cuda | cpu | mps, and RuntimeError when a requested kind has no
    device here (e.g. ``DS_ACCELERATOR=cuda`` on a machine without CUDA devices).
    """
    if name is not None:
        return _checked(_parse(name, "get_accelerator(name=...)"), "get_accelerator(name=...)")
    forced = (env.get(ACCELERATOR_ENV) or "").strip()
    if forced:
        return _checked(_parse(forced, f"{ACCELERATOR_ENV}={forced!r}"), f"{ACCELERATOR_ENV}={forced}")
    return _instance(detect_accelerator())


def detect_accelerator() -> str:
    """ "cuda" when torch sees a CUDA device (counted through NVML: no CUDA context), then "mps", then "cpu"."""
    import torch

    if torch.cuda.device_count() > 0:
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def _parse(value: str, source: str) -> str:
    kind = value.strip().lower()
    if kind not in _KINDS:
        raise ValueError(
            f"{source}: unknown accelerator {value.strip()!r}; valid values are {', '.join(VALID_ACCELERATORS)} "
            f"(set the {ACCELERATOR_ENV} environment variable to one of them, or unset it to autodetect)"
        )
    return kind


def _checked(kind: str, source: str) -> Accelerator:
    accelerator = _instance(kind)
    if not accelerator.is_available():
        raise RuntimeError(
            f"{source} asks for the {kind} accelerator, but this machine has no {kind} device visible to torch; "
            f"unset {ACCELERATOR_ENV} to autodetect or set it to one of {', '.join(VALID_ACCELERATORS)}"
        )
    return accelerator


if strict.requested():  # the device-strict test mode: see [Note: device-strict mode] in strict.py
    strict.activate()


@functools.cache
def _instance(kind: str) -> Accelerator:
    return _KINDS[kind]()
