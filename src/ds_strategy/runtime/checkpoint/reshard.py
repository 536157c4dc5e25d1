"""Re-partitioning saved flat partitions onto another layout: pure index arithmetic on ``FlatLayout``.

[Note: resharding]
A saved param group is its layout (written at world size W with some bucket size) plus, per rank, one
flat partition per kind of value (fp32 weights, exp_avg, ...). To fill any flat range of a *new* layout
(another world size, bucket size or stage), walk the new parameters that intersect the range; each is
found by name in the saved layouts, and its element range ``[a, a + n)`` is the saved flat range
``[offset + a, offset + a + n)``, which ``FlatLayout.locate`` maps to (rank, partition offset) pieces that
end at shard boundaries. Padding stays zero. Nothing depends on the stage: stage 0 fills whole buckets,
stages 1-3 fill their shards; the saved partitions are read through ``torch.load(mmap=True)``, so a rank
touches only the pages it copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..layout import FlatLayout

Partition = Callable[[int], torch.Tensor]  # saved rank -> its flat partition (of one group, one kind)


@dataclass(frozen=True)
class SavedParam:
    """Where a parameter lives in the saved checkpoint: its group and its index in that group's layout."""

    group: int
    index: int


def index_by_name(layouts: Sequence[FlatLayout]) -> dict[str, SavedParam]:
    return {slot.name: SavedParam(g, i) for g, layout in enumerate(layouts) for i, slot in enumerate(layout.params)}


def read_param_range(layout: FlatLayout, index: int, start: int, out: torch.Tensor, partition: Partition) -> None:
    """Copy elements ``[start, start + out.numel())`` of saved parameter ``index`` into ``out`` (1-D)."""
    slot = layout.params[index]
    if start < 0 or start + out.numel() > slot.numel:
        raise IndexError(f"range [{start}, {start + out.numel()}) is outside {slot.name!r} ({slot.numel} elements)")
    bucket = layout.buckets[slot.bucket]
    j, end, pos = slot.offset + start, slot.offset + start + out.numel(), 0
    while j < end:
        rank, offset = layout.locate(j)
        shard_end = bucket.start + (rank + 1) * bucket.shard
        n = min(end, shard_end) - j
        out[pos : pos + n].copy_(partition(rank)[offset : offset + n])
        j += n
        pos += n


def fill_flat_range(
    layout: FlatLayout,
    lo: int,
    out: torch.Tensor,
    *,
    saved: Sequence[FlatLayout],
    where: dict[str, SavedParam],
    partition: Callable[[int, int], torch.Tensor],
) -> None:
    """Fill ``out`` with flat range ``[lo, lo + out.numel())`` of ``layout`` from saved partitions.

    ``partition(group, rank)`` returns a saved rank's flat partition of a saved group.
    """
    hi = lo + out.numel()
    out.zero_()
    for bucket in layout.buckets:
        if bucket.end <= lo or bucket.start >= hi:
            continue
        for i in bucket.params:
            slot = layout.params[i]
            a, z = max(lo, slot.offset), min(hi, slot.end)
            if a >= z:
                continue
            src = where[slot.name]
            read_param_range(
                saved[src.group],
                src.index,
                a - slot.offset,
                out[a - lo : z - lo],
                lambda rank, g=src.group: partition(g, rank),  # type: ignore[misc]
            )


def full_param(layout: FlatLayout, index: int, partition: Partition) -> torch.Tensor:
    """One saved parameter, assembled whole (consolidation)."""
    slot = layout.params[index]
    out = torch.empty(slot.numel, dtype=torch.float32)
    read_param_range(layout, index, 0, out, partition)
    return out.view(slot.shape)
