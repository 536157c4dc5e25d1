"""Stage 3's compute-dtype parameter partitions in a swap file, read ahead of the gathers that need them.

[Note: parameter read-ahead]
Which bucket a gather wants next is not known in advance, but training repeats itself: every step gathers
the buckets in the order of the step before. The swapper records the keys it was asked for during a step
(``load``) and, while the next step follows the same sequence, keeps up to ``buffer_count`` of the coming
partitions being read into host buffers of ``buffer_size`` elements, so a gather usually finds its
partition already in memory. A partition larger than a buffer, or one the recorded order did not predict,
is read on demand. Writing a partition (after the step, or a ``GatheredParameters`` edit) first drops a
read-ahead copy of it, so nothing stale is ever gathered.
"""

from __future__ import annotations

import torch

from ds_strategy.ops.aio import AioRequest, aligned_empty

from .files import SwapFile

Key = tuple[int, int]  # (storage index, bucket)


class PartitionSwapper:
    """Parameter partitions of this rank in one swap file (see [Note: parameter read-ahead])."""

    def __init__(self, file: SwapFile, *, dtype: torch.dtype, buffer_count: int, buffer_numel: int) -> None:
        self.file = file
        self.dtype = dtype
        self.buffer_count = max(1, buffer_count)
        self.buffer_numel = max(0, buffer_numel)
        self.numel: dict[Key, int] = {}
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._ahead: dict[Key, tuple[AioRequest, torch.Tensor]] = {}
        self._trace: list[Key] = []
        self._now: list[Key] = []
        self._following = True
        self.reads_ahead_used = 0  # counters for tests and the benchmark
        self.reads_on_demand = 0

    def store(self, key: Key, value: torch.Tensor) -> None:
        """Write partition ``key`` (synchronously: a read-ahead copy of it is dropped first)."""
        self._drop(key)
        host = value.detach().to("cpu", self.dtype).contiguous()
        self.numel[key] = host.numel()
        self.file.write(key, host).wait()

    def load(self, key: Key, out: torch.Tensor) -> None:
        """Fill ``out`` (any device) with partition ``key``, from a read-ahead buffer when one holds it."""
        position = len(self._now)
        self._following = self._following and position < len(self._trace) and self._trace[position] == key
        self._now.append(key)
        hit = self._ahead.pop(key, None)
        if hit is not None:
            request, buf = hit
            request.wait()
            out.copy_(buf[: out.numel()].view_as(out))
            self._give(buf)
            self.reads_ahead_used += 1
        elif out.device.type == "cpu" and out.is_contiguous():
            self.file.read(key, out).wait()
            self.reads_on_demand += 1
        else:
            host = torch.empty(out.numel(), dtype=self.dtype)
            self.file.read(key, host).wait()
            out.copy_(host.view_as(out))
            self.reads_on_demand += 1
        if self._following:
            self._read_ahead(position + 1)

    def fetch(self, key: Key, out: torch.Tensor) -> None:
        """Fill ``out`` with partition ``key`` outside the gather order (a refresh, a checkpoint)."""
        self._drop(key)
        host = out if out.device.type == "cpu" and out.is_contiguous() else torch.empty(out.numel(), dtype=self.dtype)
        self.file.read(key, host).wait()
        if host is not out:
            out.copy_(host.view_as(out))

    def _read_ahead(self, start: int) -> None:
        for key in self._trace[start : start + self.buffer_count]:
            if key in self._ahead or self.numel.get(key, self.buffer_numel + 1) > self.buffer_numel:
                continue
            buf = self._take()
            if buf is None:
                return
            view = buf[: self.numel[key]]
            self._ahead[key] = (self.file.read(key, view), buf)

    def _take(self) -> torch.Tensor | None:
        if self._free:
            return self._free.pop()
        if self._made < self.buffer_count and self.buffer_numel > 0:
            self._made += 1
            return aligned_empty(self.buffer_numel, self.dtype)
        return None

    def _give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    def _drop(self, key: Key) -> None:
        hit = self._ahead.pop(key, None)
        if hit is not None:
            hit[0].wait()
            self._give(hit[1])

    def end_step(self) -> None:
        """A step is over: its gather order predicts the next one; start reading the first partitions."""
        for key in list(self._ahead):
            self._drop(key)
        if self._now:
            self._trace, self._now = self._now, []
        self._following = True
        self._read_ahead(0)

    def close(self) -> None:
        for key in list(self._ahead):
            self._drop(key)
        self._free.clear()
