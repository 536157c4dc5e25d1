"""One-way shared-memory channels between two processes on one host: the pipeline's point-to-point path.

    chan = ShmChannel.create(slots=8, slot_bytes=t.nbytes)   # the sending end; give chan.name to the receiver
    peer = ShmChannel.attach(name)                            # the receiving end (it unlinks the name)
    chan.send(t, poll=check)       # a copy into the next slot; blocks only while `slots` messages are unread
    peer.recv(buf, poll=check)     # a copy out of it, into a CPU tensor of the message's size

While a send or a receive waits, ``poll`` is called every 20 ms (raise from it to stop waiting: the
pipeline checks its failure notices there); a peer whose process has exited makes the wait raise at once,
and a wait longer than ``DS_STRATEGY_SHM_TIMEOUT`` seconds raises ``TimeoutError`` naming the channel. The
protocol and the segment's lifetime are described in csrc/comm/shm_channel.h. ``DS_STRATEGY_SHM=0`` turns
the channels off with the shared-memory collectives (:func:`same_host_peers` then returns no peer).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ds_strategy import env
from ds_strategy.comm.fake import is_fake_group
from ds_strategy.comm.shm import DEFAULT_TIMEOUT, TIMEOUT_ENV, env_number, host_identity, kernel_class

_SLICE_S = 0.02  # how long one kernel-side wait lasts before ``poll`` runs
_SHM_DIR = "/dev/shm"


def channel_bytes(slots: int, slot_bytes: int) -> int:
    """The segment size of a channel (the layout of csrc/comm/shm_channel.h: control lines, then per slot a
    64-byte size word and the payload rounded up to 64 bytes)."""
    return 4096 + slots * (64 + -(-max(1, slot_bytes) // 64) * 64)


def shm_free_bytes() -> int | None:
    """Free bytes of /dev/shm (None when it cannot be read): a segment larger than that would fault."""
    try:
        return shutil.disk_usage(_SHM_DIR).free
    except OSError:
        return None


def _channel_class() -> Any:
    """The compiled ``ShmChannel`` class, or None when the CPU kernels cannot be loaded or shm is off."""
    if env.is_off(env.SHM):
        return None
    try:
        return torch.classes.ds_strategy.ShmChannel if kernel_class() is not None else None
    except Exception:  # a failed build: the process-group path carries the messages instead
        return None


def _available_class() -> Any:
    kernel = _channel_class()
    if kernel is None:
        raise RuntimeError("shared-memory channels are unavailable (DS_STRATEGY_SHM=0 or no CPU kernels)")
    return kernel


def same_host_peers(peers: Iterable[int | None], group: dist.ProcessGroup | None = None) -> frozenset[int]:
    """Collective over ``group`` (its ranks are global ranks here): which of ``peers`` this rank can reach
    through a channel, i.e. share this host (same host name and boot id) and can both load the kernels.
    No peer under torch's fake process group (its other ranks are not processes)."""
    if is_fake_group(group):
        return frozenset()
    world = dist.get_world_size(group)
    facts: list[Any] = [None] * world
    dist.all_gather_object(facts, (host_identity(), _channel_class() is not None), group=group)
    mine = facts[dist.get_rank(group)]
    if not mine[1]:
        return frozenset()
    return frozenset(p for p in peers if p is not None and facts[p][1] and facts[p][0] == mine[0])


class ShmChannel:
    """One end of a one-way channel; see the module docstring. Use :meth:`create` or :meth:`attach`."""

    def __init__(self, handle: Any, timeout: float | None = None) -> None:
        self._handle = handle
        self.timeout = float(timeout) if timeout is not None else env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT)

    @classmethod
    def create(cls, slots: int, slot_bytes: int, timeout: float | None = None) -> ShmChannel:
        """The sending end, with room for ``slots`` unread messages of up to ``slot_bytes`` bytes each."""
        return cls(_available_class()("", int(slots), max(1, int(slot_bytes))), timeout)

    @classmethod
    def attach(cls, name: str, timeout: float | None = None) -> ShmChannel:
        """The receiving end of the channel the sender published as ``name``."""
        return cls(_available_class()(name, 0, 0), timeout)

    @property
    def name(self) -> str:
        return str(self._handle.name())

    @property
    def slots(self) -> int:
        return int(self._handle.slots())

    @property
    def slot_bytes(self) -> int:
        return int(self._handle.slot_bytes())

    def send(self, tensor: torch.Tensor, poll: Callable[[], None] | None = None) -> None:
        self._loop(self._handle.send, tensor, poll, "send")

    def recv(self, tensor: torch.Tensor, poll: Callable[[], None] | None = None) -> None:
        self._loop(self._handle.recv, tensor, poll, "receive")

    def close(self) -> None:
        self._handle.close()

    def _loop(self, step: Callable[[torch.Tensor, float], bool], tensor: torch.Tensor, poll: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not step(tensor, _SLICE_S):
            if poll is not None:
                poll()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shared-memory channel {self.name}: a {what} of {tensor.nbytes} bytes waited more than "
                    f"{self.timeout:g} s for the peer ({TIMEOUT_ENV} sets the limit)"
                )
