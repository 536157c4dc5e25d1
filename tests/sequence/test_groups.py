"""``SequenceGroups``: the layout of sequence- and data-parallel ranks, its ownership, and the active layout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_strategy.sequence import SequenceGroups, active_groups, set_active
from ds_strategy.sequence.groups import group_ranks
from tests.harness import run_distributed


def test_group_ranks_layout() -> None:
    assert group_ranks([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert group_ranks([0, 1, 2, 3], 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert group_ranks([0, 1, 2, 3], 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])
    assert group_ranks([4, 5, 6, 7, 8, 9], 3) == ([[4, 5, 6], [7, 8, 9]], [[4, 7], [5, 8], [6, 9]])


@pytest.mark.parametrize("sp", [3, 0, 8])
def test_bad_size_names_the_numbers(sp: int) -> None:
    with pytest.raises(
        ValueError, match=rf"sequence_parallel_size={sp} must divide the world size 4 \(valid: \[1, 2, 4\]\)"
    ):
        group_ranks([0, 1, 2, 3], sp)


def _layout_body(rank: int, world: int) -> dict[str, object]:
    groups = SequenceGroups.build(2)
    assert groups.sp_comm is not None and groups.sp_group is not None and groups.dp_group is not None
    # the groups talk to the ranks they list
    t = torch.tensor([float(rank)])
    groups.sp_comm.all_reduce(t)
    u = torch.tensor([float(rank)])
    groups.dp_comm.all_reduce(u)
    set_active(groups)
    assert active_groups() is groups
    out = {
        "sp": (groups.sp_size, groups.sp_rank, groups.sp_ranks, t.item()),
        "dp": (groups.dp_size, groups.dp_rank, groups.dp_ranks, u.item()),
        "ranks": (dist.get_process_group_ranks(groups.sp_group), dist.get_process_group_ranks(groups.dp_group)),
        "owned": len(groups.owned or ()),
    }
    groups.close()  # destroys what it made, drops the references, and clears the active layout
    out["after"] = (groups.sp_group, groups.dp_group, active_groups())
    return out


def test_layout_w4_sp2() -> None:
    res = run_distributed(_layout_body, world_size=4)
    sp_sets = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    dp_sets = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, r in enumerate(res):
        assert r["sp"] == (2, sp_sets[rank].index(rank), sp_sets[rank], float(sum(sp_sets[rank])))
        assert r["dp"] == (2, dp_sets[rank].index(rank), dp_sets[rank], float(sum(dp_sets[rank])))
        assert r["ranks"] == (sp_sets[rank], dp_sets[rank])
        assert r["owned"] == 2  # its own SP and DP groups (other ranks' are placeholders it does not own)
        assert r["after"] == (None, None, None)


def _sp1_body(rank: int, world: int) -> tuple[object, ...]:
    groups = SequenceGroups.build(1)
    t = torch.tensor([1.0])
    groups.dp_comm.all_reduce(t)
    out = (groups.sp_group, groups.sp_comm, groups.owned, groups.dp_group, groups.dp_size, groups.dp_rank, t.item())
    groups.close()
    assert dist.is_initialized()  # the base group is not ours to destroy
    return out


def test_sp1_creates_no_group() -> None:
    res = run_distributed(_sp1_body, world_size=2)
    assert res == [(None, None, None, None, 2, r, 2.0) for r in range(2)]


def _bad_body(rank: int, world: int) -> str:
    try:
        SequenceGroups.build(3)
    except ValueError as err:
        return str(err)
    return "no error"


def test_build_refuses_a_size_that_does_not_divide() -> None:
    msg = run_distributed(_bad_body, world_size=4)[0]
    assert msg == "sequence_parallel_size=3 must divide the world size 4 (valid: [1, 2, 4])", msg


def test_build_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match=r"sequence_parallel_size=2.*initialised torch\.distributed"):
        SequenceGroups.build(2)
