"""The flat partition: where every parameter element of a param group lives, on which rank.

[Note: the flat layout]
The trainable parameters of one optimizer param group are laid out, in a fixed order, into one flat
buffer. The buffer is cut into buckets at parameter boundaries (a parameter larger than the bucket size
gets a bucket of its own). Each bucket is padded to a multiple of ``world_size * alignment`` and split
into ``world_size`` equal shards: rank r owns shard r of *every* bucket. So

- every bucket is one even ``reduce_scatter`` / ``all_gather`` (shard size = padded bucket / W), and
- a rank's partition is the concatenation of its shards, one contiguous buffer of ``total / W``
  elements that holds its fp32 master weights, gradients and optimizer state.

With a single bucket this is DESIGN.md's contiguous layout (rank r owns ``[r*n/W, (r+1)*n/W)``).

[Note: whole parameters per rank]
An optimizer whose math is per tensor (Muon's orthogonalisation, Adafactor's factored moments) must step
each parameter whole, never a fragment. With ``whole_params`` every bucket's parameters are assigned to
ranks whole (largest first, each to the least loaded rank) and laid out rank by rank: rank r's shard is
its parameters back to back, then padding up to the longest rank's load. Shards stay equal, so the
reduce-scatter and all-gather are the ones above; the cost is that padding (``imbalance``), which
larger buckets (more parameters to balance) shrink.
The engine passes parameters in reverse registration order, so backward (which runs from the last
layer to the first) completes buckets in index order and their reductions overlap the rest of backward.

Everything here is integer arithmetic on the recorded per-parameter metadata: no tensors are stored,
so checkpoint resharding (another world size, another stage) can rebuild the layout and map indices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# A bucket of the engine: (index of its param group / storage, index of the bucket in that group's FlatLayout).
BucketKey = tuple[int, int]

DEFAULT_ALIGNMENT = 16  # elements: shard boundaries fall on 64-byte lines for fp32 (SIMD-friendly)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int  # into the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketSlot:
    """A run of whole parameters, padded so it splits into ``world_size`` equal shards."""

    index: int
    start: int  # flat offset of the first element
    numel: int  # parameter elements (unpadded)
    padded: int  # multiple of world_size * alignment
    shard: int  # padded // world_size: elements each rank owns
    partition_start: int  # where this bucket's shard sits inside a rank's partition
    params: tuple[int, ...]  # indices into FlatLayout.params

    @property
    def end(self) -> int:
        return self.start + self.padded


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls into one rank's shard of its bucket."""

    param: int  # index into FlatLayout.params
    param_offset: int  # first element within the (flattened) parameter
    numel: int
    partition_offset: int  # where it sits in the rank's partition


class FlatLayout:
    """Per-parameter and per-bucket index arithmetic of one param group (see [Note: the flat layout])."""

    def __init__(self, params: Sequence[ParamSlot], buckets: Sequence[BucketSlot], world_size: int) -> None:
        self.params = tuple(params)
        self.buckets = tuple(buckets)
        self.world_size = world_size
        self.total = self.buckets[-1].end if self.buckets else 0
        self.partition_numel = self.total // world_size if world_size else 0
        self._gaps: dict[int, list[tuple[int, int]]] = {}  # per bucket, computed on first use

    @classmethod
    def build(
        cls,
        entries: Sequence[tuple[str, torch.Size | tuple[int, ...], torch.dtype]],
        *,
        world_size: int,
        bucket_numel: int,
        alignment: int = DEFAULT_ALIGNMENT,
        breaks: Collection[int] = (),
        whole_params: bool = False,
    ) -> FlatLayout:
        """Lay out ``(name, shape, dtype)`` entries in the given order.

        ``bucket_numel`` is the bucket capacity in elements; a bucket closes before the parameter that
        would overflow it, and a parameter larger than the capacity forms its own bucket. A bucket also
        closes before every entry index in ``breaks`` (stage 3 aligns buckets with modules).
        ``whole_params``: each parameter whole in one rank's shard ([Note: whole parameters per rank]).
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if bucket_numel < 1:
            raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
        if alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        unit = world_size * alignment
        groups: list[list[int]] = []
        sizes = [_numel(shape) for _, shape, _ in entries]
        current: list[int] = []
        filled = 0
        for i, n in enumerate(sizes):
            if current and (filled + n > bucket_numel or i in breaks):
                groups.append(current)
                current, filled = [], 0
            current.append(i)
            filled += n
        if current:
            groups.append(current)

        params: list[ParamSlot | None] = [None] * len(entries)
        buckets: list[BucketSlot] = []
        start = 0
        partition_start = 0
        totals = [0] * world_size  # whole_params: each rank's elements so far, over the buckets
        for b, members in enumerate(groups):
            numel = sum(sizes[i] for i in members)
            if whole_params:
                owners = _assign_whole(members, sizes, totals)
                load = max(sum(sizes[i] for i in mine) for mine in owners)
                shard = max(alignment, -(-load // alignment) * alignment)
                padded = shard * world_size
                for r, mine in enumerate(owners):
                    offset = start + r * shard
                    for i in mine:
                        name, shape, dtype = entries[i]
                        params[i] = ParamSlot(name, tuple(shape), dtype, b, offset, sizes[i])
                        offset += sizes[i]
            else:
                offset = start
                for i in members:
                    name, shape, dtype = entries[i]
                    params[i] = ParamSlot(name, tuple(shape), dtype, b, offset, sizes[i])
                    offset += sizes[i]
                padded = max(unit, -(-numel // unit) * unit)
                shard = padded // world_size
            buckets.append(BucketSlot(b, start, numel, padded, shard, partition_start, tuple(members)))
            start += padded
            partition_start += shard
        assert all(p is not None for p in params)
        return cls([p for p in params if p is not None], buckets, world_size)

    # ----------------------------------------------------------------- index arithmetic
    def locate(self, flat_index: int) -> tuple[int, int]:
        """Flat index -> (owning rank, offset inside that rank's partition)."""
        bucket = self._bucket_of(flat_index)
        within = flat_index - bucket.start
        rank, in_shard = divmod(within, bucket.shard)
        return rank, bucket.partition_start + in_shard

    def flat_index(self, rank: int, partition_offset: int) -> int:
        """(rank, offset inside its partition) -> flat index; the inverse of ``locate``."""
        if not 0 <= rank < self.world_size or not 0 <= partition_offset < self.partition_numel:
            raise IndexError(
                f"(rank {rank}, partition offset {partition_offset}) is outside world size {self.world_size} "
                f"x partition {self.partition_numel}"
            )
        for bucket in self.buckets:
            if partition_offset < bucket.partition_start + bucket.shard:
                return bucket.start + rank * bucket.shard + (partition_offset - bucket.partition_start)
        raise AssertionError("unreachable: partition offsets are covered by the buckets")

    def shard_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """Flat ``[start, end)`` of ``rank``'s shard of ``bucket``."""
        b = self.buckets[bucket]
        return b.start + rank * b.shard, b.start + (rank + 1) * b.shard

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """Every parameter fragment that ``rank`` owns, in partition order (padding left out)."""
        pieces: list[ShardPiece] = []
        for bucket in self.buckets:
            lo, hi = self.shard_range(bucket.index, rank)
            for i in bucket.params:
                slot = self.params[i]
                a, z = max(lo, slot.offset), min(hi, slot.end)
                if a < z:
                    pieces.append(ShardPiece(i, a - slot.offset, z - a, bucket.partition_start + (a - lo)))
        return pieces

    def _bucket_of(self, flat_index: int) -> BucketSlot:
        if not 0 <= flat_index < self.total:
            raise IndexError(f"flat index {flat_index} is outside the layout of {self.total} elements")
        lo, hi = 0, len(self.buckets) - 1
        while lo < hi:  # buckets are sorted by start: binary search
            mid = (lo + hi + 1) // 2
            if self.buckets[mid].start <= flat_index:
                lo = mid
            else:
                hi = mid - 1
        return self.buckets[lo]

    def gaps(self, bucket: int) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` ranges of ``bucket`` (relative to its start) no parameter covers: its padding, at the
        end, or between ranks' runs under [Note: whole parameters per rank]."""
        if bucket in self._gaps:
            return self._gaps[bucket]
        b = self.buckets[bucket]
        out: list[tuple[int, int]] = []
        at = 0
        for slot in sorted((self.params[i] for i in b.params), key=lambda s: s.offset):
            if slot.offset - b.start > at:
                out.append((at, slot.offset - b.start))
            at = slot.end - b.start
        if at < b.padded:
            out.append((at, b.padded))
        self._gaps[bucket] = out
        return out

    def owner(self, index: int) -> int | None:
        """The rank whose shard holds all of parameter ``index``, or None if it spans shards."""
        slot = self.params[index]
        if slot.numel == 0:
            return self.locate(slot.offset)[0] if slot.offset < self.total else None
        first, last = self.locate(slot.offset)[0], self.locate(slot.end - 1)[0]
        return first if first == last else None

    def imbalance(self) -> float:
        """Padded elements over parameter elements (1.0: no padding beyond the alignment)."""
        numel = sum(b.numel for b in self.buckets)
        return self.total / numel if numel else 1.0

    # ----------------------------------------------------------------- views
    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        slot = self.params[index]
        return flat[slot.offset : slot.end].view(slot.shape)

    def bucket_view(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        b = self.buckets[bucket]
        return flat[b.start : b.end]

    def shard_view(self, flat: torch.Tensor, bucket: int, rank: int) -> torch.Tensor:
        lo, hi = self.shard_range(bucket, rank)
        return flat[lo:hi]

    def partition_view(self, partition: torch.Tensor, bucket: int) -> torch.Tensor:
        """Bucket ``bucket``'s view into a partition buffer (one slice: the gradient hooks call it per bucket,
        and building every bucket's view there made a backward quadratic in the bucket count)."""
        if partition.numel() != self.partition_numel:
            raise ValueError(f"partition has {partition.numel()} elements, the layout needs {self.partition_numel}")
        b = self.buckets[bucket]
        return partition[b.partition_start : b.partition_start + b.shard]

    def partition_views(self, partition: torch.Tensor) -> list[torch.Tensor]:
        """Per-bucket views into a contiguous partition buffer of ``partition_numel`` elements."""
        if partition.numel() != self.partition_numel:
            raise ValueError(f"partition has {partition.numel()} elements, the layout needs {self.partition_numel}")
        return [partition[b.partition_start : b.partition_start + b.shard] for b in self.buckets]

    # ----------------------------------------------------------------- (de)serialisation for checkpoints
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "bucket": p.bucket,
                    "offset": p.offset,
                    "numel": p.numel,
                }
                for p in self.params
            ],
            "buckets": [
                {
                    "index": b.index,
                    "start": b.start,
                    "numel": b.numel,
                    "padded": b.padded,
                    "shard": b.shard,
                    "partition_start": b.partition_start,
                    "params": list(b.params),
                }
                for b in self.buckets
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FlatLayout:
        params = [
            ParamSlot(p["name"], tuple(p["shape"]), getattr(torch, p["dtype"]), p["bucket"], p["offset"], p["numel"])
            for p in data["params"]
        ]
        buckets = [
            BucketSlot(
                b["index"], b["start"], b["numel"], b["padded"], b["shard"], b["partition_start"], tuple(b["params"])
            )
            for b in data["buckets"]
        ]
        return cls(params, buckets, int(data["world_size"]))

    def __repr__(self) -> str:
        return (
            f"FlatLayout({len(self.params)} params, {len(self.buckets)} buckets, {self.total} elements, "
            f"world_size={self.world_size})"
        )


def _numel(shape: torch.Size | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _assign_whole(members: Sequence[int], sizes: Sequence[int], totals: list[int]) -> list[list[int]]:
    """``members`` (one bucket) split among the ranks whole: into ``len(totals)`` bins balanced by size
    (largest first into the lightest bin: the bucket's padding is its heaviest bin), then the heaviest bin to
    the rank with the fewest elements so far (``totals``, updated), so single-parameter buckets spread out.
    Each rank's list keeps the original order."""
    world = len(totals)
    bins: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for i in sorted(members, key=lambda i: (-sizes[i], i)):
        k = min(range(world), key=lambda k: (loads[k], k))
        bins[k].append(i)
        loads[k] += sizes[i]
    ranks = sorted(range(world), key=lambda r: (totals[r], r))
    owners: list[list[int]] = [[] for _ in range(world)]
    for k, r in zip(sorted(range(world), key=lambda k: (-loads[k], k)), ranks, strict=True):
        owners[r] = sorted(bins[k])
        totals[r] += loads[k]
    return owners
