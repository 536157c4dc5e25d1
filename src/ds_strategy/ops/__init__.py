"""Compiled kernels (built lazily on first use) with pure-torch fallbacks.

Importing this package compiles nothing: the first call that needs a kernel builds the library into the
cache (see :mod:`ds_strategy.ops.builder`), later calls and later processes load it in milliseconds.
``python -m ds_strategy.ops build`` pre-builds everything.
"""

from __future__ import annotations

from ds_strategy.ops.builder import KernelBuildError, load_cpu_kernels, load_cuda_kernels
from ds_strategy.ops.lock import KernelBuildTimeout
from ds_strategy.ops.norm import multi_tensor_l2norm
from ds_strategy.ops.optim_step import fused_adagrad_step, fused_adam_step, fused_lion_step
from ds_strategy.ops.optimizers import CPUAdagrad, CPUAdam, CPULion, FusedAdam

__all__ = [
    "CPUAdagrad",
    "CPUAdam",
    "CPULion",
    "FusedAdam",
    "KernelBuildError",
    "KernelBuildTimeout",
    "fused_adagrad_step",
    "fused_adam_step",
    "fused_lion_step",
    "load_cpu_kernels",
    "load_cuda_kernels",
    "multi_tensor_l2norm",
]
