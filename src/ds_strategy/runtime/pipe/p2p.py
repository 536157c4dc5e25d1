"""Point-to-point transport between neighbouring stages, and the failure channel that keeps it hang-free.

Sends are asynchronous (``isend``; completed at the end of the batch), receives are posted (``irecv``) and
then polled: while a receive is pending the rank also watches the store of the default process group for
a failure notice, so a rank waiting on a stage that raised fails with that stage's name instead of
waiting forever ([Note: a failing stage]).

Shapes and dtypes cross the link once per direction and mode (train / eval): the first message on a
link is a small int64 header (count, then dtype code, requires_grad, ndim and dims per tensor); every
later micro-batch sends only the payload into buffers of the negotiated shape.

Between CPU stages on one host the payloads go through a shared-memory channel instead of the process
group (``comm/shm_channel.py``: one copy in, one copy out, no socket): the sender creates it when it
negotiates the link, sized from the header (per tensor, as many slots as the 1F1B schedule can have
messages in flight on that link, ``schedule.link_depth``: a send never waits on a full channel), and
publishes its name in the store before the header leaves; the receiver attaches after reading the
header. When /dev/shm has no room for the channel, that link stays on the process group (a warning says
so). ``DS_STRATEGY_SHM=0`` keeps every payload on the process group.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_strategy.accelerator import strict
from ds_strategy.comm.shm_channel import ShmChannel, channel_bytes, shm_free_bytes

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_HEADER = 64


class PipelineStageError(RuntimeError):
    """A pipeline stage raised; raised on every rank of the pipeline grid, naming the stage(s) at fault."""


class PeerFailed(Exception):
    """Internal: another rank posted a failure notice while this one waited on a receive."""


def _pack_header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline activations of dtype {t.dtype} cannot be sent; valid: {_DTYPES}")
        values += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(values) > _HEADER:
        raise ValueError(f"pipeline stage output has too many tensors/dims to describe in {_HEADER} integers")
    return torch.tensor(values + [0] * (_HEADER - len(values)), dtype=torch.int64)


def _unpack_header(header: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    v = header.tolist()
    count, at, out = v[0], 1, []
    for _ in range(count):
        code, grad, ndim = v[at], v[at + 1], v[at + 2]
        shape = tuple(v[at + 3 : at + 3 + ndim])
        out.append((shape, _DTYPES[code], bool(grad)))
        at += 3 + ndim
    return out


class _Done(threading.Event):
    error: BaseException | None = None


class _Waiter:
    """A daemon thread that calls ``Work.wait()`` for each submitted work, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, _Done]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, work: Any) -> _Done:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds-pipe-p2p", daemon=True)
            self._thread.start()
        done = _Done()
        self._queue.put((work, done))
        return done

    def _run(self) -> None:
        while True:
            work, done = self._queue.get()
            if work is None:  # close()
                return
            try:
                work.wait()
            except BaseException as e:
                done.error = e
            done.set()
            # Hold no finished Work while waiting for the next: it keeps its gloo context (and a gloo thread)
            # alive after the group is destroyed, into interpreter finalisation (comm/ownership.py).
            del work, done

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put((None, _Done()))
            thread.join(timeout=5)


def _make_channel(slots: int, slot_bytes: int, what: str) -> ShmChannel | None:
    """A channel for the link, or None (with a warning) when /dev/shm has no room for it."""
    need = channel_bytes(slots, slot_bytes)
    free = shm_free_bytes()
    if free is not None and need > free:
        warnings.warn(
            f"pipeline {what}: a shared-memory channel needs {need / 2**20:.1f} MiB but /dev/shm has "
            f"{free / 2**20:.1f} MiB free; this link uses the process group (enlarge /dev/shm, e.g. docker "
            "--shm-size, to get the channel back)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return ShmChannel.create(slots, slot_bytes)


class Link:
    """This rank's sends and receives on the default group, aware of the failure notices under ``prefix``."""

    def __init__(
        self, device: torch.device, store: Any, shm_peers: frozenset[int] = frozenset(), channel_prefix: str = ""
    ) -> None:
        self.device = device
        self.store = store
        self.prefix = ""
        # Only CPU stages; and not in the device-strict mode, which rehearses what a GPU would take (NCCL).
        self.shm_peers = shm_peers if device.type == "cpu" and not strict.ACTIVE else frozenset()
        self.channel_prefix = channel_prefix
        self.channels: dict[tuple[tuple[str, int, str], int], ShmChannel] = {}
        self.capacity: dict[int, int] = {}  # peer -> slots per tensor of a channel made during this call
        self.pending: list[Any] = []
        self.meta: dict[tuple[str, int, str], list[tuple[tuple[int, ...], torch.dtype, bool]]] = {}
        self.negotiations = 0  # headers exchanged (a test checks it stays at one per link and mode)
        # One daemon thread blocks in Work.wait; after a peer failed it may stay blocked (the group is dead),
        # and being a daemon it does not keep the process from exiting.
        self._waiter = _Waiter()

    # ------------------------------------------------------------------ failure notices
    def failed_flag(self) -> str:
        return f"{self.prefix}/failed"

    def post_failure(self, rank: int, message: str) -> None:
        self.store.set(f"{self.prefix}/error/{rank}", message)
        self.store.set(self.failed_flag(), "1")

    def failure_message(self, rank: int) -> str:
        return self.store.get(f"{self.prefix}/error/{rank}").decode()

    def _poll(self, what: str) -> Callable[[], None]:
        def check() -> None:
            if self.store.check([self.failed_flag()]):
                raise PeerFailed(what)

        return check

    def _channel_key(self, key: tuple[str, int, str], dst: int) -> str:
        return f"{self.channel_prefix}/{key[0]}/{key[1]}->{dst}/{key[2]}"

    def _wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` on the waiter thread (gloo's ``is_completed`` only turns true in ``wait``), while
        watching for a failure notice every 20 ms."""
        done = self._waiter.submit(work)
        while not done.wait(timeout=0.02):
            if self.store.check([self.failed_flag()]):
                raise PeerFailed(what)
        if done.error is not None:
            raise done.error

    # ------------------------------------------------------------------ tensors
    def send(self, tensors: Sequence[torch.Tensor], dst: int, key: tuple[str, int, str]) -> None:
        if key not in self.meta:
            header = _pack_header(tensors)
            self.meta[key] = _unpack_header(header)
            self.negotiations += 1
            if dst in self.shm_peers:
                slots = self.capacity.get(dst, 1) * max(len(tensors), 1)
                # an empty message (a frozen stage's input gradients) still needs a channel: at least 1 byte
                made = _make_channel(slots, max([1, *(t.nbytes for t in tensors)]), f"{key[0]} to rank {dst}")
                if made is not None:
                    self.channels[(key, dst)] = made
                # Before the header (see the module docstring); "" tells the receiver to use the process group.
                self.store.set(self._channel_key(key, dst), made.name if made is not None else "")
            self.pending.append(dist.isend(header.to(self.device), dst=dst))
        else:
            want = self.meta[key]
            got = [(tuple(t.shape), t.dtype) for t in tensors]
            if got != [(s, d) for s, d, _ in want]:
                raise ValueError(
                    f"pipeline {key[0]} tensors to rank {dst} changed from the negotiated "
                    f"{[(s, str(d)) for s, d, _ in want]} to {[(s, str(d)) for s, d in got]}: every micro-batch "
                    "must have the shapes of the first (pad the last batch or drop it: drop_last=True)"
                )
        chan = self.channels.get((key, dst))
        for t in tensors:
            if chan is not None:
                chan.send(t.detach().contiguous(), poll=self._poll(f"{key[0]} to rank {dst}"))
            else:
                self.pending.append(dist.isend(t.detach().contiguous(), dst=dst))

    def recv(self, src: int, key: tuple[str, int, str]) -> list[torch.Tensor]:
        if key not in self.meta:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(header, src=src), f"header from rank {src}")
            self.meta[key] = _unpack_header(header.cpu())
            self.negotiations += 1
            if src in self.shm_peers:
                name = self.store.get(self._channel_key(key, dist.get_rank())).decode()
                if name:
                    self.channels[(key, src)] = ShmChannel.attach(name)
        chan = self.channels.get((key, src))
        what = f"{key[0]} from rank {src}"
        out = []
        for shape, dtype, _ in self.meta[key]:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            if chan is not None:
                chan.recv(buf, poll=self._poll(what))
            else:
                self._wait(dist.irecv(buf, src=src), what)
            out.append(buf)
        return out

    def requires_grad(self, key: tuple[str, int, str]) -> list[bool]:
        return [g for _, _, g in self.meta[key]]

    def close(self) -> None:
        """Unmap every shared-memory channel of this rank and stop the waiter thread (the link is unusable
        afterwards)."""
        for chan in self.channels.values():
            chan.close()
        self.channels.clear()
        self._waiter.close()

    def drain(self) -> None:
        """Complete this batch's sends (each was matched by a receive of the batch)."""
        pending, self.pending = self.pending, []
        for work in pending:
            self._wait(work, "a send")
