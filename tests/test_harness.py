"""The harness itself: results come back per rank, a raising rank is named, a hanging rank times out,
a skipping rank skips, the default group rendezvouses through a FileStore and MASTER_PORT is reserved."""

from __future__ import annotations

import os
import time
from pathlib import Path

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


def _default_store_kind(rank: int, world_size: int) -> tuple[str, float]:
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    t = torch.ones(1)
    dist.all_reduce(t)
    return type(store).__name__, t.item()


def test_default_group_rendezvous_through_a_file_store() -> None:
    # MASTER_PORT=1 cannot be bound by a test: the group must not depend on it.
    seen = run_distributed(_default_store_kind, world_size=2, env={"MASTER_PORT": "1"})
    assert seen == [("FileStore", 2.0), ("FileStore", 2.0)]


def _master_port_state(rank: int, world_size: int) -> tuple[bool, float]:
    import errno
    import os
    import socket

    port = int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            reserved = False
        except OSError as e:
            reserved = e.errno == errno.EADDRINUSE
    dist.init_process_group("gloo")  # env:// through MASTER_ADDR/MASTER_PORT, as Lightning does
    t = torch.ones(1)
    dist.all_reduce(t)
    return reserved, t.item()


def test_master_port_is_reserved_while_the_call_runs() -> None:
    # Without a process group the body rendezvouses itself: the port it is given is held by the parent
    # (no other process can be handed it), yet rank 0's TCPStore can still listen on it.
    assert run_distributed(_master_port_state, world_size=2, init_process_group=False) == [(True, 2.0)] * 2


def _skip_on_rank1(rank: int, world_size: int, then_wait: bool) -> int:
    if rank == 1:
        pytest.skip("planted skip on rank one")
    if then_wait:
        time.sleep(3600)  # a peer stuck waiting for rank 1, which never comes
    return rank


def test_a_rank_that_skips_skips_the_test() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"rank 1: planted skip on rank one"):
        run_distributed(_skip_on_rank1, world_size=2, args=(False,), timeout=30)
    assert run_distributed(_all_reduce_rank, world_size=2, args=(1.0,)) == [1.0, 1.0]


def test_a_skip_that_strands_a_peer_still_skips_and_the_pool_recovers() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"(?s)rank 1: planted skip.*ranks \[0\] were still running"):
        run_distributed(_skip_on_rank1, world_size=2, args=(True,), timeout=60)
    assert run_distributed(_all_reduce_rank, world_size=2, args=(1.0,)) == [1.0, 1.0]


def _fail_rank0_skip_rank1(rank: int, world_size: int) -> None:
    if rank == 0:
        raise ValueError("planted failure on rank zero")
    pytest.skip("planted skip on rank one")


def test_a_failure_outweighs_a_skip() -> None:
    with pytest.raises(DistributedTestError, match=r"(?s)rank 0 raised.*planted failure on rank zero"):
        run_distributed(_fail_rank0_skip_rank1, world_size=2, timeout=30)


def test_ports_come_from_this_workers_range_and_a_held_one_is_never_handed_out() -> None:
    """Rendezvous ports come from DS_STRATEGY_PORT_RANGE (tests/conftest.py: one range per xdist worker,
    below the kernel's ephemeral ports), so a test beside this one cannot be handed the same port."""
    from benchmarks.common import PORT_RANGE_ENV, free_port

    from tests.harness import held_port

    span = os.environ.get(PORT_RANGE_ENV)
    if not span:
        pytest.skip("no port range fits below this machine's ephemeral ports (tests/conftest.py)")
    lo, hi = (int(x) for x in span.split("-"))
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert hi <= min(ephemeral_low, 29000)
    with held_port() as port:
        assert lo <= port < hi
        others = {free_port() for _ in range(200)}
        assert port not in others and all(lo <= p < hi for p in others)
