"""The fp32 masters, their optimizer state and (stage 3) their gradient partitions in a swap file, brought
into host memory one sub-group (tile) at a time for the optimizer step.

[Note: swapped tensors]
A swapped tensor keeps its identity and loses its bytes: ``t.data`` is a 0-element placeholder while it is
on disk and a view of a host buffer while it is in. The optimizer's ``param_groups`` and ``state`` dicts,
the stage's ``masters`` lists and user references all stay valid; a use outside a swap-in fails on a shape
instead of reading stale memory. Optimizer state entries are found afresh in ``optimizer.state`` at every
swap (a checkpoint load replaces them): the tensors of at least one dimension whose element count is the
master's (``step`` counters stay in memory).

[Note: the step pipeline]
``step`` walks the tiles in order with a pool of host buffers, each holding a whole tile (masters, state
and gradients, each at an aligned offset). ``buffer_count`` counts tensors, as in DeepSpeed ("at least the
number of states maintained per parameter by the optimizer": Adam at stage 3 keeps four per sub-group:
master, gradient, two moments), so the pool holds ``buffer_count // tensors per tile`` tiles, at least one,
and a DeepSpeed config sizes host memory the same here. With two tiles or more and ``pipeline_read`` the
next tile is read while the current one steps (its read is issued before the step, after waiting for the
oldest write if every other buffer is still being written: a pool full of landed-but-unreaped writes
would otherwise stop the read-ahead); with ``pipeline_write`` a stepped tile is written back while the
next one steps, its buffer returning to the pool when the write lands. With one tile (Adam and
``buffer_count`` < 8) each transfer completes before the step goes on, and a pipeline asked for is
reported once. Host memory is therefore the pool's tiles, whatever the model's size. Before the first tile
the heap is trimmed (the backward's freed blocks would otherwise sit under the pool), and after the last
an unpinned pool goes back to the OS (page faults are cheap, and forward and backward do not need it);
a pinned pool (CUDA) is kept, since pinning costs more than the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ds_strategy.log import get_logger
from ds_strategy.ops.aio import AioRequest, io_buffer

from ..host_memory import trim_heap  # [Note: host memory under NVMe offload] in __init__.py
from .files import SwapFile, _align

Key = tuple[int, int]  # (group, bucket)
log = get_logger("ds_strategy.runtime")


def placeholder(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


@dataclass
class _Entry:
    tensor: torch.Tensor  # the swapped tensor object (a master, a state tensor or a gradient holder)
    file_key: tuple[Any, ...]
    numel: int
    dtype: torch.dtype
    write_back: bool  # masters and state; gradients are consumed by the step


class _Pool:
    """``count`` aligned byte buffers (page-locked with CUDA), grown (never shrunk) to the largest tile asked for."""

    def __init__(self, count: int) -> None:
        self.count = max(1, count)
        self.capacity = 0
        self.free: list[torch.Tensor] = []
        self.made = 0

    def resize(self, count: int) -> None:
        """Hold at most ``count`` buffers from now on (the free ones beyond it go)."""
        self.count = max(1, count)
        while self.free and self.made > self.count:
            self.free.pop()
            self.made -= 1

    def release(self) -> None:
        """Give the free buffers back unless they are page-locked (see [Note: the step pipeline])."""
        if any(b.is_pinned() for b in self.free):
            return
        self.made -= len(self.free)
        self.free.clear()

    def available(self) -> bool:
        return bool(self.free) or self.made < self.count

    def reserve(self, nbytes: int) -> None:
        """Grow every buffer to at least ``nbytes`` now (the ones in the pool are dropped and remade)."""
        if nbytes > self.capacity:
            self.capacity = nbytes
            self.free.clear()
            self.made = 0

    def take(self, nbytes: int) -> torch.Tensor:
        self.reserve(nbytes)  # state appeared after the first step: every buffer grows once
        if self.free:
            return self.free.pop()
        assert self.made < self.count, "the caller waits for a buffer before taking one"
        self.made += 1
        return io_buffer(self.capacity, torch.uint8)  # pinned with CUDA: the masters feed the device from here

    def give(self, buf: torch.Tensor) -> None:
        if buf.numel() == self.capacity:  # a buffer from before the pool grew is dropped
            self.free.append(buf)


class _Transfer:
    """Requests in flight and what they keep alive until they land."""

    def __init__(self, requests: list[AioRequest], keep: list[Any], on_done: Callable[[], None] | None = None) -> None:
        self.requests, self.keep, self.on_done = requests, keep, on_done

    def done(self) -> bool:
        return all(r.done() for r in self.requests)

    def wait(self) -> None:
        for r in self.requests:
            r.wait()
        self.requests, self.keep = [], []
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            done()


class OptimizerSwapper:
    """Masters, optimizer state and gradient partitions of this rank in one swap file (see the notes)."""

    def __init__(
        self, file: SwapFile, *, buffer_count: int, pipeline_read: bool, pipeline_write: bool, report: bool = True
    ) -> None:
        self.file = file
        self.buffer_count = max(1, buffer_count)  # tensors, as in DeepSpeed: see [Note: the step pipeline]
        self.pool = _Pool(1)
        self.pipeline_read = self.pipeline_write = False  # set per step, from the tiles the pool holds
        self._pipeline = (pipeline_read, pipeline_write)
        self._reported = not report  # one rank says it
        self.key_of: dict[nn.Parameter, Key] = {}
        self.numel: dict[nn.Parameter, int] = {}
        self.grad_of: dict[nn.Parameter, torch.Tensor] = {}  # stage 3: gradient holders, swapped like masters
        self.state_dtypes: dict[nn.Parameter, dict[str, torch.dtype]] = {}
        self.optimizer: Optimizer | None = None
        self.resident_depth = 0
        self._writes: list[_Transfer] = []
        self._grad_writes: dict[Key, _Transfer] = {}

    # ------------------------------------------------------------------ set-up
    def store(self, key: Key, master: torch.Tensor) -> None:
        """Write a master's initial values (fp32); stage 3 hands the device partition, aio reads host memory."""
        self.file.write(("m", key), master.detach().to("cpu", torch.float32).contiguous()).wait()

    def bind(self, master: nn.Parameter, key: Key, numel: int) -> None:
        """``master`` lives in the file from now on (its values were ``store``d); leave it a placeholder."""
        self.key_of[master] = key
        self.numel[master] = numel
        master.data = placeholder(torch.float32)

    def bind_grad(self, master: nn.Parameter, holder: torch.Tensor) -> None:
        self.grad_of[master] = holder

    # ------------------------------------------------------------------ gradients (stage 3)
    def put_grad(self, master: nn.Parameter, value: torch.Tensor) -> None:
        """Write a landed gradient partition behind the backward (``value`` is kept until it lands)."""
        key = self.key_of[master]
        self._wait_grad(key)
        host = value if value.device.type == "cpu" else value.to("cpu")
        self._grad_writes[key] = _Transfer([self.file.write(("g", key), host)], [host])
        if len(self._grad_writes) > 2 * self.pool.count:  # bounded: the oldest must land first
            oldest = next(iter(self._grad_writes))
            self._grad_writes.pop(oldest).wait()

    def get_grad(self, master: nn.Parameter, out: torch.Tensor) -> None:
        """Read the gradient partition written so far this window into ``out`` (accumulation)."""
        key = self.key_of[master]
        self._wait_grad(key)
        host = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        self.file.read(("g", key), host).wait()
        if host is not out:
            out.copy_(host)

    def _wait_grad(self, key: Key) -> None:
        pending = self._grad_writes.pop(key, None)
        if pending is not None:
            pending.wait()

    def flush(self) -> None:
        for t in list(self._grad_writes.values()) + self._writes:
            t.wait()
        self._grad_writes.clear()
        self._writes.clear()

    # ------------------------------------------------------------------ tiles
    def _entries(self, masters: Iterable[nn.Parameter], *, states: bool, grads: bool) -> list[_Entry]:
        out: list[_Entry] = []
        for m in masters:
            key, n = self.key_of[m], self.numel[m]
            if states:
                out.append(_Entry(m, ("m", key), n, torch.float32, True))
                for name, dtype in self.state_dtypes.get(m, {}).items():
                    t = self._state(m).get(name)
                    if isinstance(t, torch.Tensor):
                        out.append(_Entry(t, ("s", key, name), n, dtype, True))
            if grads and m in self.grad_of:
                out.append(_Entry(self.grad_of[m], ("g", key), n, torch.float32, False))
        return out

    def _state(self, master: nn.Parameter) -> dict[str, Any]:
        if self.optimizer is None:
            return {}
        return self.optimizer.state.get(master, {})

    @staticmethod
    def _nbytes(entries: Sequence[_Entry]) -> int:
        return sum(_align(e.numel * e.dtype.itemsize) for e in entries)

    def _read(self, entries: list[_Entry]) -> tuple[torch.Tensor, _Transfer]:
        """Start reading ``entries`` into one pool buffer; the tensors point into it at once."""
        self._make_room()
        buf = self.pool.take(self._nbytes(entries))
        requests, offset = [], 0
        for e in entries:
            view = buf[offset : offset + e.numel * e.dtype.itemsize].view(e.dtype)
            offset += _align(e.numel * e.dtype.itemsize)
            if e.file_key[0] == "g":
                self._wait_grad(e.file_key[1])
            requests.append(self.file.read(e.file_key, view))
            e.tensor.data = view
        return buf, _Transfer(requests, [])

    def _make_room(self) -> None:
        while not self.pool.available() and self._writes:
            self._writes.pop(0).wait()

    def _reap(self) -> None:
        """Return the buffers of the writes that have landed (oldest first, while they have)."""
        while self._writes and self._writes[0].done():
            self._writes.pop(0).wait()

    def _write_out(self, entries: list[_Entry], buf: torch.Tensor | None) -> _Transfer:
        """Write the masters and state of a stepped tile back; every entry becomes a placeholder."""
        requests, keep = [], []
        for e in entries:
            if e.write_back:
                data = e.tensor.data
                if not data.is_contiguous():
                    data = data.contiguous()
                requests.append(self.file.write(e.file_key, data))
                keep.append(data)
            e.tensor.data = placeholder(e.dtype)
        pool = self.pool
        return _Transfer(requests, keep, (lambda: pool.give(buf)) if buf is not None else None)

    def _record_states(self, masters: Iterable[nn.Parameter]) -> None:
        """Learn the swappable state of each master after a step (see [Note: swapped tensors])."""
        for m in masters:
            n = self.numel[m]
            found = {
                name: t.dtype
                for name, t in self._state(m).items()
                if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.numel() == n
            }
            self.state_dtypes[m] = found

    def step(self, tiles: Sequence[Sequence[nn.Parameter]], run: Callable[[int], None]) -> None:
        """Bring each tile in (its masters, state and gradients), ``run(t)``, write it back behind (see
        [Note: the step pipeline])."""
        self.flush()
        trim_heap()  # the backward's freed blocks, before the pool's buffers come (see the note)
        self._size_pool(tiles)
        reads: dict[int, tuple[torch.Tensor, _Transfer, list[_Entry]]] = {}

        def start(t: int) -> None:
            entries = self._entries(tiles[t], states=True, grads=True)
            buf, transfer = self._read(entries)
            reads[t] = (buf, transfer, entries)

        for t in range(len(tiles)):
            if t not in reads:
                start(t)
            if self.pipeline_read and t + 1 < len(tiles):
                # The next tile's read goes out before this tile steps, whatever it takes: the buffers of
                # landed writes first, else the oldest write's (it must land before that read anyway).
                self._reap()
                start(t + 1)
            buf, transfer, entries = reads.pop(t)
            transfer.wait()
            known = {m: dict(self.state_dtypes.get(m, {})) for m in tiles[t]}
            run(t)
            self._record_states(tiles[t])
            # The step may have created state (the first step): write it back with the rest.
            entries = [e for e in entries if e.file_key[0] != "s"] + [
                e for e in self._entries(tiles[t], states=True, grads=False) if e.file_key[0] == "s"
            ]
            write = self._write_out(entries, buf)
            created = any(self.state_dtypes.get(m) != known[m] for m in tiles[t])
            if self.pipeline_write and not created:
                self._writes.append(write)
            else:  # new state lives outside the pool: let it go before the next tile makes more
                write.wait()
                if created:  # the first step: its state blocks were malloc'd one tile at a time
                    trim_heap()
        self.flush()
        self.pool.release()

    def _size_pool(self, tiles: Sequence[Sequence[nn.Parameter]]) -> None:
        """Every buffer at the largest tile's size from the start (the pool would otherwise grow tile by tile),
        as many as ``buffer_count`` tensors allow (see [Note: the step pipeline])."""
        entries = [self._entries(tile, states=True, grads=True) for tile in tiles]
        self.pool.reserve(max((self._nbytes(e) for e in entries), default=0))
        per_tile = max((len(e) / max(1, len(tile)) for e, tile in zip(entries, tiles, strict=True)), default=1.0)
        held = max(1, int(self.buffer_count // max(1.0, per_tile)))
        self.pool.resize(held)
        self.pipeline_read, self.pipeline_write = (held > 1 and self._pipeline[0], held > 1 and self._pipeline[1])
        if held == 1 and len(tiles) > 1 and any(self._pipeline) and not self._reported and self.state_dtypes:
            self._reported = True
            need = 2 * round(per_tile)
            log.warning(
                "zero_optimization.offload_optimizer.buffer_count: %d buffers hold one sub-group of %d tensors "
                "(master, gradient and optimizer states), so pipeline_read / pipeline_write cannot overlap; "
                "buffer_count >= %d overlaps the step with its reads and writes (each buffer is one tensor "
                "of a sub-group in host memory)",
                self.buffer_count,
                round(per_tile),
                need,
            )

    def stream_grads(self, tiles: Sequence[Sequence[nn.Parameter]]) -> Iterator[list[torch.Tensor]]:
        """Each tile's gradient partitions in turn (read-only: the norm before the step)."""
        self.flush()
        for tile in tiles:
            entries = self._entries(tile, states=False, grads=True)
            buf, transfer = self._read(entries)
            transfer.wait()
            yield [e.tensor for e in entries]
            for e in entries:
                e.tensor.data = placeholder(e.dtype)
            self.pool.give(buf)

    # ------------------------------------------------------------------ everything at once
    def swap_in_all(self) -> None:
        """Every master, state and gradient into host memory of its own (checkpoints, full-state access)."""
        self.resident_depth += 1
        if self.resident_depth > 1:
            return
        self.flush()
        for e in self._entries(self.key_of, states=True, grads=True):
            if self.file.has(e.file_key):
                e.tensor.data = torch.empty(e.numel, dtype=e.dtype)
                self.file.read(e.file_key, e.tensor.data).wait()
            else:  # a gradient before the first backward
                e.tensor.data = torch.zeros(e.numel, dtype=e.dtype)

    def swap_out_all(self) -> None:
        self.resident_depth -= 1
        if self.resident_depth > 0:
            return
        self._record_states(self.key_of)
        for e in self._entries(self.key_of, states=True, grads=True):
            if e.tensor.numel() == e.numel:  # grads may have been dropped (a step inside the block)
                self.file.write(e.file_key, e.tensor.data.contiguous()).wait()
            e.tensor.data = placeholder(e.dtype)

    @property
    def resident(self) -> bool:
        return self.resident_depth > 0

    def bytes_on_disk(self) -> int:
        return self.file.bytes_used()
