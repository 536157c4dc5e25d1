"""Pure-torch twins of every kernel: used when no compiler works, and as the reference in tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def multi_tensor_l2norm(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Global L2 norm over all tensors (accumulated in float64) and a 0/1 flag for any inf or NaN."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return zero, zero.clone()
    squares = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors])
    found_inf = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
    return squares.sum().sqrt().float(), found_inf.float()
