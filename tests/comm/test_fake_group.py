"""torch's fake process group ([Note: the fake process group] in comm/distributed.py): one process as rank r
of N, no peers. The communicator opens no shared-memory path (its first barrier would wait for peers that do
not exist) and sends everything through torch.distributed, which the fake group answers at once;
``init_distributed`` reuses a fake group or creates one; nothing at exit waits for peers. In the pytest
process: the fake group needs no workers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ds_strategy.comm import CommsLogger, Communicator, init_distributed, is_fake_backend, is_fake_group
from tests.fake_pg import fake_group

WORLD = 4


@pytest.fixture
def shm_on(monkeypatch: pytest.MonkeyPatch, cpu_kernels: bool) -> None:
    """The shared-memory path would be taken if the group were real: kernels built, DS_STRATEGY_SHM unset; a
    short kernel timeout so that a regression (a segment with no peers) raises instead of hanging."""
    monkeypatch.delenv("DS_STRATEGY_SHM", raising=False)
    monkeypatch.setenv("DS_STRATEGY_SHM_TIMEOUT", "5")


def test_is_fake_backend() -> None:
    assert is_fake_backend("fake") and is_fake_backend("cpu:fake,cuda:fake") and is_fake_backend("FAKE")
    assert not any(is_fake_backend(b) for b in ("gloo", "nccl", "cpu:gloo,cuda:nccl", "fakeish"))
    assert not is_fake_group()  # no group at all


@pytest.mark.usefixtures("shm_on")
def test_communicator_takes_torch_paths_under_a_fake_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.comm.shm import ShmCommunicator
    from ds_strategy.comm.shm_channel import same_host_peers

    with fake_group(monkeypatch, world_size=WORLD, rank=1):
        assert is_fake_group()
        assert ShmCommunicator.create() is None
        assert same_host_peers([0, 2, 3]) == frozenset()
        logger = CommsLogger()
        with Communicator(logger=logger) as comm:
            assert (comm.rank, comm.world_size, comm.is_fake, comm.has_peers) == (1, WORLD, True, False)
            assert comm.fast_path is None
            flat, shard = torch.ones(WORLD * 8), torch.full((8,), 2.0)
            assert comm.path_for("sum", flat) == "fake"
            comm.all_reduce(flat, "avg")
            comm.reduce_scatter_tensor(shard, flat)
            comm.all_gather_into_tensor(flat, shard)
            handle = comm.all_gather_into_tensor(flat, shard, async_op=True)
            # Landed at once, as a real rank's collective is once done: torch's fake work never says so.
            assert handle.is_completed()
            handle.wait()
            comm.broadcast(shard, src=0)
            comm.all_reduce_coalesced([torch.ones(3), torch.ones(2, dtype=torch.bfloat16)])
            comm.barrier()
            # The fake group writes this rank's input into every rank's slot: what arrived is not the others'.
            assert torch.equal(flat, shard.repeat(WORLD))
        rows = {(s.op, s.path): s.count for s in logger.summary()}
        assert rows == {
            ("all_reduce", "fake"): 1,
            ("reduce_scatter", "fake"): 1,
            ("all_gather", "fake"): 2,
            ("broadcast", "fake"): 1,
            ("all_reduce_coalesced", "fake"): 2,
            ("barrier", "fake"): 1,
        }, rows
        with pytest.raises(RuntimeError, match="fake process group"):
            Communicator(fast_path=True)
    assert not is_fake_group()


def test_init_distributed_reuses_a_fake_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.comm.ownership import _meet_peers_before_teardown

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with fake_group(monkeypatch, world_size=8, rank=5):
        info = init_distributed()
        assert (info.source, info.rank, info.world_size, info.backend) == ("existing", 5, 8, "fake")
        assert info.local_rank == 0  # every simulated rank computes on this process's device
        _meet_peers_before_teardown()  # the fake store holds nothing: no meeting through it


def test_init_distributed_creates_a_fake_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_process_group wraps it
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match="pass world_size"):
        init_distributed(dist_backend="fake")
    try:
        info = init_distributed(dist_backend="fake", rank=3, world_size=8)
        assert (info.source, info.rank, info.world_size, info.local_rank) == ("fake", 3, 8, 0)
        assert dist.get_world_size() == 8 and is_fake_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
