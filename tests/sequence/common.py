"""Helpers shared by the sequence-parallel tests: the layout a body builds, and its slice of a sequence."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ds_strategy.sequence import SequenceGroups, set_active


@contextmanager
def layout(sp: int, active: bool = True) -> Iterator[SequenceGroups]:
    """``SequenceGroups.build(sp)`` (made active unless told not to), closed afterwards."""
    groups = SequenceGroups.build(sp)
    if active:
        set_active(groups)
    try:
        yield groups
    finally:
        groups.close()
        set_active(None)


def shard(x: torch.Tensor, groups: SequenceGroups, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (the sequence)."""
    n = x.shape[dim] // groups.sp_size
    return x.narrow(dim, groups.sp_rank * n, n)
