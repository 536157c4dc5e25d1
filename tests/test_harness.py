"""The harness itself: results come back per rank, a raising rank is named, a hanging rank times out."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.multiprocess


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("planted failure on rank one")
    return rank


def _hang_on_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)


def _env_seen(rank: int, world_size: int) -> tuple[str, str, bool]:
    import os

    return os.environ["RANK"], os.environ["EXTRA"], dist.is_initialized()


def test_results_per_rank() -> None:
    assert run_distributed(_all_reduce_rank, world_size=2, args=(2.0,)) == [2.0, 2.0]


def test_raising_rank_is_named() -> None:
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 raised.*planted failure on rank one"):
        run_distributed(_raise_on_rank1, world_size=2, timeout=30)
    # The pool is replaced and still serves the next test.
    assert run_distributed(_all_reduce_rank, world_size=2, args=(1.0,)) == [1.0, 1.0]


def test_hanging_rank_times_out_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)ranks \[0\] did not finish.*_hang_on_rank0"):
        run_distributed(_hang_on_rank0, world_size=2, timeout=3)
    assert time.monotonic() - start < 20


def test_env_without_process_group() -> None:
    seen = run_distributed(_env_seen, world_size=2, init_process_group=False, env={"EXTRA": "x"})
    assert seen == [("0", "x", False), ("1", "x", False)]
