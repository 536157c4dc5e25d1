"""Shared-memory channels (the pipeline's point-to-point path): bytes arrive unchanged and in order, a full
channel blocks instead of overwriting, a mismatch or a dead peer raises, a wait stops when the caller's poll
raises or its timeout passes, and no name is left in /dev/shm once both ends are mapped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_strategy.comm.shm_channel import ShmChannel
from tests.harness import run_distributed

pytestmark = [pytest.mark.kernels]

SHM_DIR = "/dev/shm"


def _exists(name: str) -> bool:
    return os.path.exists(SHM_DIR + name)


def _pair(slots: int, slot_bytes: int, timeout: float = 5.0) -> tuple[ShmChannel, ShmChannel]:
    tx = ShmChannel.create(slots, slot_bytes, timeout=timeout)
    assert _exists(tx.name)
    rx = ShmChannel.attach(tx.name, timeout=timeout)
    assert not _exists(tx.name), "the receiver unlinks the name as soon as it is mapped"
    return tx, rx


def test_messages_arrive_in_order_and_a_full_channel_blocks() -> None:
    tx, rx = _pair(slots=2, slot_bytes=64, timeout=0.2)
    sent = [torch.arange(16, dtype=torch.float32) * k for k in range(5)]
    tx.send(sent[0])
    tx.send(sent[1])
    with pytest.raises(TimeoutError, match="send of 64 bytes waited"):  # both slots unread: nothing overwritten
        tx.send(sent[2])
    for k in range(5):
        if k >= 2:
            tx.send(sent[k])
        out = torch.empty(16)
        rx.recv(out)
        assert torch.equal(out, sent[k])


def test_any_dtype_travels_as_bytes() -> None:
    tx, rx = _pair(slots=3, slot_bytes=4 * 10)
    for t in (torch.randn(10), torch.randint(-5, 5, (5,), dtype=torch.int64), torch.rand(20).to(torch.bfloat16)):
        tx.send(t)
        out = torch.empty_like(t)
        rx.recv(out)
        assert torch.equal(out, t)


def test_size_mismatch_and_oversized_messages_raise() -> None:
    tx, rx = _pair(slots=2, slot_bytes=32)
    with pytest.raises(RuntimeError, match="does not fit the channel's 64-byte slots"):
        tx.send(torch.zeros(17))
    tx.send(torch.zeros(4))
    with pytest.raises(RuntimeError, match="has 16 bytes, the receiver expected 32"):
        rx.recv(torch.empty(8))


@pytest.mark.serial
def test_poll_stops_a_wait_and_the_timeout_names_the_channel() -> None:
    tx, rx = _pair(slots=1, slot_bytes=8, timeout=0.3)
    calls = []

    def poll() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise InterruptedError("peer failed")

    start = time.monotonic()
    with pytest.raises(InterruptedError):
        rx.recv(torch.empty(2), poll=poll)
    assert time.monotonic() - start < 0.25  # three ~20 ms slices, not the timeout
    with pytest.raises(TimeoutError, match=rf"channel {tx.name}: a receive of 8 bytes waited more than 0.3 s"):
        rx.recv(torch.empty(2))


_CHILD = """
import sys
from ds_strategy.comm.shm_channel import ShmChannel
tx = ShmChannel.create(1, 8)
print(tx.name, flush=True)
sys.stdin.readline()   # the parent has attached: exit without sending
"""


def test_a_receiver_whose_sender_exited_raises_naming_it() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdin is not None
    name = child.stdout.readline().strip()
    rx = ShmChannel.attach(name, timeout=30)
    child.stdin.write("\n")
    child.stdin.close()
    child.wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"sending process \(pid {child.pid}\) has exited"):
        rx.recv(torch.empty(2))
    assert time.monotonic() - start < 5


def _across(rank: int, world: int) -> Any:
    box = [None]
    if rank == 0:
        tx = ShmChannel.create(2, 4 * 1000)
        box = [tx.name]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        rx = ShmChannel.attach(str(box[0]))
    dist.barrier()
    got = []
    for k in range(9):  # 9 messages through 2 slots: the sender waits on the (slower) receiver
        if rank == 0:
            tx.send(torch.full((1000,), float(k)))
        else:
            time.sleep(0.005)
            out = torch.empty(1000)
            rx.recv(out)
            got.append(out.unique().tolist())
    return got


@pytest.mark.multiprocess
def test_two_processes() -> None:
    _, got = run_distributed(_across, world_size=2, timeout=60)
    assert got == [[float(k)] for k in range(9)]


def test_channel_bytes_is_the_segment_size() -> None:
    """What the pipeline checks against /dev/shm's free space before it creates a channel."""
    from ds_strategy.comm.shm_channel import channel_bytes

    for slots, slot_bytes in ((1, 1), (3, 100), (8, 4096), (2, 1 << 20)):
        tx = ShmChannel.create(slots, slot_bytes)
        name = tx.name
        assert os.stat(SHM_DIR + name).st_size == channel_bytes(slots, slot_bytes)
        tx.close()
        assert not _exists(name)  # a sender closed before anyone attached removes its name
