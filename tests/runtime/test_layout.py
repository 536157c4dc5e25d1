"""The flat layout: bucketing at parameter boundaries, padding, ownership arithmetic, views."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_strategy.runtime.layout import DEFAULT_ALIGNMENT, FlatLayout


def _entries(sizes: list[int]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(f"p{i}", (n,), torch.float32) for i, n in enumerate(sizes)]


def test_buckets_close_at_parameter_boundaries_and_big_params_stand_alone() -> None:
    layout = FlatLayout.build(_entries([30, 30, 50, 500, 10]), world_size=2, bucket_numel=100, alignment=4)
    assert [b.params for b in layout.buckets] == [(0, 1), (2,), (3,), (4,)]
    assert [b.numel for b in layout.buckets] == [60, 50, 500, 10]
    assert [b.padded for b in layout.buckets] == [64, 56, 504, 16]  # multiples of world x alignment
    assert [b.start for b in layout.buckets] == [0, 64, 120, 624]
    assert [b.partition_start for b in layout.buckets] == [0, 32, 60, 312]
    assert layout.total == 640 and layout.partition_numel == 320
    assert [(p.bucket, p.offset) for p in layout.params] == [(0, 0), (0, 30), (1, 64), (2, 120), (3, 624)]


def test_one_bucket_is_the_contiguous_layout_of_the_design() -> None:
    layout = FlatLayout.build(_entries([7, 9, 33]), world_size=4, bucket_numel=10**9)
    assert len(layout.buckets) == 1
    n = layout.total
    assert n % (4 * DEFAULT_ALIGNMENT) == 0 and n >= 49
    for r in range(4):
        assert layout.shard_range(0, r) == (r * n // 4, (r + 1) * n // 4)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    world=st.integers(1, 5),
    bucket=st.integers(1, 400),
    align=st.sampled_from([1, 4, 16]),
)
def test_index_arithmetic_round_trips(sizes: list[int], world: int, bucket: int, align: int) -> None:
    layout = FlatLayout.build(_entries(sizes), world_size=world, bucket_numel=bucket, alignment=align)
    assert layout.total == world * layout.partition_numel
    for b in layout.buckets:
        assert b.padded % (world * align) == 0 and b.padded >= b.numel
        assert sum(layout.params[i].numel for i in b.params) == b.numel
    owners = torch.full((layout.total,), -1)
    for flat in range(layout.total):
        rank, offset = layout.locate(flat)
        assert layout.flat_index(rank, offset) == flat
        owners[flat] = rank
    # Every rank owns exactly partition_numel elements, and every parameter element exactly once.
    assert all(int((owners == r).sum()) == layout.partition_numel for r in range(world))
    covered = {i: torch.zeros(layout.params[i].numel, dtype=torch.int64) for i in range(len(sizes))}
    for r in range(world):
        for piece in layout.shard_pieces(r):
            covered[piece.param][piece.param_offset : piece.param_offset + piece.numel] += 1
            slot = layout.params[piece.param]
            assert layout.locate(slot.offset + piece.param_offset) == (r, piece.partition_offset)
    assert all(bool((c == 1).all()) for c in covered.values())


def test_views_alias_the_flat_buffer_and_partitions_concatenate_shards() -> None:
    layout = FlatLayout.build(
        [("w", (3, 5), torch.float32), ("b", (5,), torch.float32)], world_size=2, bucket_numel=16, alignment=2
    )
    flat = torch.arange(layout.total, dtype=torch.float32)
    w = layout.param_view(flat, 0)
    assert w.shape == (3, 5) and w.data_ptr() == flat.data_ptr()
    partition = torch.cat([layout.shard_view(flat, b, 1) for b in range(len(layout.buckets))])
    views = layout.partition_views(partition)
    assert [v.numel() for v in views] == [b.shard for b in layout.buckets]
    for flat_index in range(layout.total):
        rank, offset = layout.locate(flat_index)
        if rank == 1:
            assert partition[offset] == flat[flat_index]
    with pytest.raises(ValueError, match="partition has"):
        layout.partition_views(torch.zeros(3))


def test_serialises_for_checkpoints() -> None:
    layout = FlatLayout.build(
        [("a", (4, 4), torch.bfloat16), ("b", (3,), torch.float16)], world_size=3, bucket_numel=10
    )
    again = FlatLayout.from_dict(layout.to_dict())
    assert again.params == layout.params and again.buckets == layout.buckets and again.total == layout.total


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build(_entries([3]), world_size=0, bucket_numel=4)
    with pytest.raises(ValueError, match="bucket size"):
        FlatLayout.build(_entries([3]), world_size=1, bucket_numel=0)
    layout = FlatLayout.build(_entries([3]), world_size=2, bucket_numel=4)
    with pytest.raises(IndexError, match="outside"):
        layout.locate(layout.total)
    with pytest.raises(IndexError, match="outside"):
        layout.flat_index(2, 0)
