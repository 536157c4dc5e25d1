"""Stage 3's compute-dtype parameter partitions in a swap file, read ahead of the gathers that need them and
written back behind the step.

[Note: parameter read-ahead]
Which bucket a gather wants next is not known in advance, but training repeats itself: every step gathers
the buckets in the order of the step before. The swapper records the keys it was asked for during a step
(``load``) and, while the next step follows the same sequence, keeps the reads of the next partitions in
flight, each into a host buffer, so a gather finds its partition in memory or waits for the read already in
flight; it never starts a read of its own. As in DeepSpeed, ``buffer_count`` x ``buffer_size`` elements
is the host memory for them: reads go ahead while they fit in it, at most ``buffer_count`` and always the
next one. Buffers hold ``buffer_size`` elements (fewer when the largest partition is smaller); a larger
partition is read ahead all the same, into a buffer of its own that goes when it is used. Only the first
step (nothing recorded yet) and a gather the recorded order did not predict read on demand
(``reads_on_demand``). A step that skips keys of the recorded order (the step that recorded it gathered
the last block again for its backward; later steps keep it gathered) picks the order up again at the key
it asked for. Writing a partition first drops a read-ahead copy of it, so nothing stale is ever gathered.

[Note: parameter write-behind]
``store`` (the step's updated partitions, a ``GatheredParameters`` edit) copies the partition into a
write buffer (a pool of them, reused: no heap churn) and issues the write without waiting for it: the
step goes on while the disk writes. At most ``buffer_count`` writes are in flight (the oldest is waited
for first). A partition is never read
while its write is in flight: every read of a key (read-ahead, on demand, ``fetch``) first completes the
key's write, and a second write of a key waits for the first (the engine may reorder requests in flight).
``flush`` / ``close`` complete them all.

[Note: pinned swap buffers]
With CUDA, the buffers between the file and the device are page-locked (``io_buffer``): a gather's copy of
a read-ahead partition to the device is asynchronous (``non_blocking``), and the buffer is reused for the
next read only when a CUDA event recorded after the copy has completed. Without CUDA they are ordinary
aligned memory, as before (pinning would only cost host memory).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_strategy.ops.aio import AioRequest, io_buffer

from .files import SwapFile

Key = tuple[int, int]  # (storage index, bucket)


class _Ahead:
    """A read-ahead in flight: the request, its buffer, and whether the buffer returns to the pool."""

    __slots__ = ("buf", "pooled", "request")

    def __init__(self, request: AioRequest, buf: torch.Tensor, pooled: bool) -> None:
        self.request, self.buf, self.pooled = request, buf, pooled


class PartitionSwapper:
    """Parameter partitions of this rank in one swap file (see the notes)."""

    def __init__(self, file: SwapFile, *, dtype: torch.dtype, buffer_count: int, buffer_numel: int) -> None:
        self.file = file
        self.dtype = dtype
        self.buffer_count = max(1, buffer_count)
        self.buffer_numel = max(0, buffer_numel)
        self.numel: dict[Key, int] = {}
        self._capacity = 0  # elements of a pooled buffer, fixed when the first is made
        self._free: list[tuple[torch.Tensor, Any]] = []  # (buffer, CUDA event of its last copy or None)
        self._made = 0
        self._ahead: dict[Key, _Ahead] = {}
        self._writes: dict[Key, tuple[AioRequest, torch.Tensor]] = {}  # in flight, oldest first
        self._write_free: list[torch.Tensor] = []
        self._write_capacity = 0  # elements of a pooled write buffer
        self._trace: list[Key] = []
        self._now: list[Key] = []
        self._cursor: int | None = 0  # position in ``_trace`` (None: this step left the recorded order)
        self.reads_ahead_used = 0  # counters for tests and the benchmark
        self.reads_on_demand = 0
        self.writes_behind = 0

    # ------------------------------------------------------------------ writes
    def store(self, key: Key, value: torch.Tensor) -> None:
        """Write partition ``key`` behind (see [Note: parameter write-behind]); ``value`` may change at once."""
        self._drop(key)
        self._wait_write(key)
        self._reap_writes()
        while len(self._writes) >= self.buffer_count:
            self._wait_write(next(iter(self._writes)))
        flat = value.detach().reshape(-1)
        n = flat.numel()
        self.numel[key] = n
        buf = self._write_buffer(n)
        buf[:n].copy_(flat)  # synchronous: the write must see every byte
        self._writes[key] = (self.file.write(key, buf[:n]), buf)
        self.writes_behind += 1

    def _write_buffer(self, numel: int) -> torch.Tensor:
        """A buffer for a write of ``numel`` elements: a pooled one (reused, so writes do not churn the heap;
        the pool grows while the engine stores its first partitions) or, above ``buffer_size``, its own."""
        if numel > self._write_capacity and self._write_capacity < self.buffer_numel:
            self._write_capacity = min(self.buffer_numel, max(self.numel.values()))
            self._write_free.clear()
        if numel > self._write_capacity:
            return io_buffer(numel, self.dtype)
        if self._write_free:
            return self._write_free.pop()
        return io_buffer(self._write_capacity, self.dtype)

    def _wait_write(self, key: Key) -> None:
        pending = self._writes.pop(key, None)
        if pending is not None:
            pending[0].wait()
            if pending[1].numel() == self._write_capacity:
                self._write_free.append(pending[1])

    def _reap_writes(self) -> None:
        """Let go of the buffers of writes that have landed (oldest first, while they have)."""
        while self._writes:
            key, (request, _) = next(iter(self._writes.items()))
            if not request.done():
                return
            self._wait_write(key)

    def flush(self) -> None:
        """Complete every write in flight."""
        for key in list(self._writes):
            self._wait_write(key)

    # ------------------------------------------------------------------ reads
    def load(self, key: Key, out: torch.Tensor) -> None:
        """Fill ``out`` (any device) with partition ``key``, from its read-ahead when one is in flight."""
        self._now.append(key)
        self._follow(key)
        hit = self._ahead.pop(key, None)
        if hit is not None:
            hit.request.wait()
            self._copy_out(hit.buf[: out.numel()].view_as(out), out, hit)
            self.reads_ahead_used += 1
        else:
            self._read_now(key, out)
            self.reads_on_demand += 1
        if self._cursor is not None:
            self._read_ahead(self._cursor)

    def _follow(self, key: Key) -> None:
        """Move the cursor past ``key`` in the recorded order. A key further on (the step skipped some: a
        bucket kept gathered that the recording step gathered again) resyncs it there and drops the
        read-aheads skipped over; a key not ahead at all leaves the order (no read-ahead until the next step)."""
        cursor, trace = self._cursor, self._trace
        if cursor is None:
            return
        if cursor < len(trace) and trace[cursor] == key:
            self._cursor = cursor + 1
            return
        try:
            self._cursor = trace.index(key, cursor) + 1
        except ValueError:
            self._cursor = None
            return
        upcoming = set(trace[self._cursor : self._cursor + self.buffer_count])
        for skipped in [k for k in self._ahead if k != key and k not in upcoming]:
            self._drop(skipped)

    def fetch(self, key: Key, out: torch.Tensor) -> None:
        """Fill ``out`` with partition ``key`` outside the gather order (a refresh, a checkpoint)."""
        self._drop(key)
        self._read_now(key, out)

    def _read_now(self, key: Key, out: torch.Tensor) -> None:
        self._wait_write(key)
        host = out if out.device.type == "cpu" and out.is_contiguous() else torch.empty(out.numel(), dtype=self.dtype)
        self.file.read(key, host).wait()
        if host is not out:
            out.copy_(host.view_as(out))

    def _copy_out(self, src: torch.Tensor, out: torch.Tensor, hit: _Ahead) -> None:
        """Copy a read-ahead buffer into ``out``; a pinned buffer goes to the device asynchronously and is
        reused once the copy's event has completed (see [Note: pinned swap buffers])."""
        event = None
        if out.device.type == "cuda" and hit.buf.is_pinned():
            out.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            out.copy_(src)
        if hit.pooled:
            self._free.append((hit.buf, event))

    def _read_ahead(self, start: int) -> None:
        """Keep the reads of the next recorded keys in flight, as many as the budget allows (see the note)."""
        for key in self._trace[start : start + self.buffer_count]:
            if key in self._ahead or key not in self.numel:
                continue
            n = self.numel[key]
            if len(self._ahead) >= self.buffer_count or (self._ahead and self._ahead_numel() + n > self._budget):
                return
            buf, pooled = self._take(n)
            self._wait_write(key)  # [Note: parameter write-behind]
            self._ahead[key] = _Ahead(self.file.read(key, buf[:n]), buf, pooled)

    @property
    def _budget(self) -> int:
        """Elements read ahead at most (beyond the next partition): ``buffer_count`` x ``buffer_size``."""
        return self.buffer_count * self.buffer_numel if self.buffer_numel else 1 << 62

    def _ahead_numel(self) -> int:
        return sum(self.numel[k] for k in self._ahead)

    def _take(self, numel: int) -> tuple[torch.Tensor, bool]:
        """A buffer for ``numel`` elements: a pooled one when it fits, else one of its own."""
        if not self._made:
            largest = max(self.numel.values(), default=0)
            self._capacity = min(self.buffer_numel, largest) if self.buffer_numel else 0
        if numel > self._capacity:
            return io_buffer(numel, self.dtype), False
        for i, (buf, event) in enumerate(self._free):
            if event is None or event.query():
                del self._free[i]
                return buf, True
        if self._made < self.buffer_count:
            self._made += 1
            return io_buffer(self._capacity, self.dtype), True
        buf, event = self._free.pop(0)  # every pooled buffer's copy to the device is still running
        event.synchronize()
        return buf, True

    def _drop(self, key: Key) -> None:
        hit = self._ahead.pop(key, None)
        if hit is not None:
            hit.request.wait()
            if hit.pooled:
                self._free.append((hit.buf, None))

    def end_step(self) -> None:
        """A step is over: its gather order predicts the next one; start reading the first partitions."""
        for key in list(self._ahead):
            self._drop(key)
        if self._now:
            self._trace, self._now = self._now, []
        self._cursor = 0
        self._read_ahead(0)

    def close(self) -> None:
        for key in list(self._ahead):
            self._drop(key)
        self.flush()
        self._free.clear()
        self._write_free.clear()
