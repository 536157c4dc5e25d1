"""The safe-value rule, ``to_plain``, and the pure resharding arithmetic (no processes)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from ds_strategy.runtime.checkpoint import CheckpointError, check_safe, to_plain
from ds_strategy.runtime.checkpoint.format import ranks
from ds_strategy.runtime.checkpoint.reshard import fill_flat_range, full_param, index_by_name
from ds_strategy.runtime.layout import FlatLayout


def test_check_safe_names_the_key() -> None:
    check_safe({"a": [1, 2.0, "x", None, (True,)], "t": torch.ones(2), "d": torch.float16}, "client_state")
    with pytest.raises(CheckpointError, match=r"client_state\['a'\]\[1\] is a builtins.object"):
        check_safe({"a": [1, object()]}, "client_state")
    with pytest.raises(CheckpointError, match=r"convert it with dict"):
        check_safe({"a": OrderedDict(b=1)}, "client_state")


def test_to_plain() -> None:
    Point = namedtuple("Point", "x y")
    value = to_plain({"o": OrderedDict(b=[Point(1, 2)]), "s": torch.Size([2, 3])})
    check_safe(value, "v")
    assert value == {"o": {"b": [(1, 2)]}, "s": torch.Size([2, 3])}
    assert type(value["o"]["b"][0]) is tuple


@pytest.mark.parametrize("old_world,new_world,old_bucket,new_bucket", [(2, 1, 40, 1000), (2, 4, 40, 17), (3, 2, 7, 64)])
def test_reshard_round_trip(old_world: int, new_world: int, old_bucket: int, new_bucket: int) -> None:
    """Partition a flat tensor at one layout, fill every rank's partition at another from it, and get the
    same parameters back: the arithmetic load_checkpoint uses, at odd sizes that split parameters."""
    entries = [(f"p{i}", shape, torch.float32) for i, shape in enumerate([(5, 3), (17,), (1,), (4, 4, 2), (33,)])]
    old = FlatLayout.build(entries, world_size=old_world, bucket_numel=old_bucket, alignment=1)
    new = FlatLayout.build(entries, world_size=new_world, bucket_numel=new_bucket, alignment=4)
    values = {name: torch.randn(shape) for name, shape, _ in entries}
    flat = torch.zeros(old.total)
    for i, slot in enumerate(old.params):
        old.param_view(flat, i).copy_(values[slot.name])
    parts = [torch.cat([old.shard_view(flat, b.index, r) for b in old.buckets]) for r in range(old_world)]
    where = index_by_name([old])
    for i, slot in enumerate(old.params):
        assert torch.equal(full_param(old, i, lambda r: parts[r]), values[slot.name])
    new_flat = torch.full((new.total,), float("nan"))
    for r in range(new_world):
        for b in new.buckets:
            lo, hi = new.shard_range(b.index, r)
            fill_flat_range(new, lo, new_flat[lo:hi], saved=[old], where=where, partition=lambda g, rank: parts[rank])
    for i, slot in enumerate(new.params):
        assert torch.equal(new.param_view(new_flat, i), values[slot.name])
    padding = torch.ones(new.total, dtype=torch.bool)
    for slot in new.params:
        padding[slot.offset : slot.end] = False
    assert torch.all(new_flat[padding] == 0)


def test_rank_counts_in_words() -> None:
    assert [ranks(n) for n in (0, 1, 2, 16)] == ["0 ranks", "1 rank", "2 ranks", "16 ranks"]
