"""Fused global L2 norm + inf/nan check over many tensors (gradient clipping, fp16 overflow detection)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_strategy.ops import fallback
from ds_strategy.ops.builder import load_cpu_kernels, load_cuda_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def multi_tensor_l2norm(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm, found_inf)``: the L2 norm of all elements of all tensors as one vector (fp32
    0-dim tensor) and 1.0 when any element is inf or NaN, else 0.0.

    One pass over memory on CPU (OpenMP + SIMD) and CUDA; other devices and dtypes use the pure-torch
    reference in :mod:`ds_strategy.ops.fallback`, which gives the same result.
    """
    tensors = [t.detach() for t in tensors if t.numel() > 0]
    if not tensors:
        return fallback.multi_tensor_l2norm([])
    device = tensors[0].device
    usable = all(t.device == device and t.dtype in _KERNEL_DTYPES for t in tensors)
    kernel_ready = (device.type == "cpu" and load_cpu_kernels()) or (device.type == "cuda" and load_cuda_kernels())
    if not (usable and kernel_ready):
        return fallback.multi_tensor_l2norm(tensors)
    # Read-only op: a contiguous copy of a strided view is harmless here (nothing is written back).
    norm, found_inf = torch.ops.ds_strategy.multi_tensor_l2norm([t.contiguous() for t in tensors])
    return norm, found_inf


def multi_tensor_sum_of_squares(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(sum_sq, found_inf)``: the float64 sum of squares behind :func:`multi_tensor_l2norm` (whose
    norm is ``sqrt(sum_sq)`` rounded to fp32) and the inf/NaN flag. Sums over disjoint sets of CPU tensors
    add up to the whole set's (NVMe offload streams its gradients a sub-group at a time)."""
    tensors = [t.detach() for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float32)
    usable = all(t.device.type == "cpu" and t.dtype in _KERNEL_DTYPES for t in tensors)
    if usable and load_cpu_kernels():
        total, found_inf = torch.ops.ds_strategy.multi_tensor_sum_of_squares([t.contiguous() for t in tensors])
        return total, found_inf
    squares = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors])
    found = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
    return squares.sum().cpu(), found.float().cpu()
