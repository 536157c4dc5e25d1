"""The engine's only door to torch.distributed: all_reduce, reduce_scatter and all_gather on flat buffers.

Every call takes the explicit process group held by ``Collectives`` and returns a handle whose
``wait()`` finishes the operation (including any copy-out), so stages can launch asynchronously and
overlap communication with backward. ``ds_strategy.comm`` (facade + shared-memory backend) will be
routed in here later; nothing else in ``runtime/`` calls torch.distributed for gradients or parameters.

[Note: gloo scatter/gather through all_reduce]
gloo implements reduce_scatter and all_gather far slower than all_reduce. Measured on this 2-core
machine, 2 ranks, 30M fp32 elements: all_reduce 88 ms, reduce_scatter_tensor 161 ms,
all_gather_into_tensor 155 ms. On gloo we therefore emulate both with one all_reduce: reduce_scatter
sums the whole input in place and keeps this rank's shard; all_gather zeroes the other shards of the
output, writes this rank's shard and sums (x + 0 is exact in every float format, so the gathered values
are bit-identical). The emulation moves the same bytes per rank for W=2 and keeps the semantics the
stages rely on; NCCL (and any other backend) uses the native collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class _Then:
    """Wait for a torch.distributed work object, then run a finishing step (e.g. copy a shard out)."""

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


DONE: Handle = _Done()


class Collectives:
    """Collectives over one data-parallel process group (see [Note: gloo scatter/gather through all_reduce])."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, emulate_with_all_reduce: bool | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.emulate = self.backend == "gloo" if emulate_with_all_reduce is None else emulate_with_all_reduce

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0) -> None:
        """Copy group rank ``src``'s ``tensor`` to every rank (synchronous; used once at start-up)."""
        if self.world_size > 1:
            global_src = src if self.group is None else dist.get_global_rank(self.group, src)
            dist.broadcast(tensor, src=global_src, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum ``tensor`` over the group, in place."""
        if self.world_size == 1:
            return DONE
        return self._finish(dist.all_reduce(tensor, group=self.group, async_op=async_op), None, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle:
        """``output`` = this rank's shard of the group-wide sum of ``input`` (``input.numel() == W * output.numel()``).

        ``input`` may be overwritten. ``output`` may be a view of this rank's shard of ``input``.
        """
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements, expected {self.world_size} x {output.numel()}"
            )
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return DONE
        if not self.emulate:
            work = _reduce_scatter(output, input, group=self.group, async_op=async_op)
            return self._finish(work, None, async_op)
        mine = input.view(self.world_size, -1)[self.rank]

        def keep_shard() -> None:
            if output.data_ptr() != mine.data_ptr():
                output.copy_(mine)

        work = dist.all_reduce(input, group=self.group, async_op=async_op)
        return self._finish(work, keep_shard, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may be this rank's shard of ``output``."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather: output has {output.numel()} elements, expected {self.world_size} x {input.numel()}"
            )
        shards = output.view(self.world_size, -1)
        mine = shards[self.rank]
        if self.world_size == 1:
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input)
            return DONE
        if not self.emulate:
            return self._finish(_all_gather(output, input, group=self.group, async_op=async_op), None, async_op)
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        if self.rank > 0:
            shards[: self.rank].zero_()
        if self.rank < self.world_size - 1:
            shards[self.rank + 1 :].zero_()
        return self._finish(dist.all_reduce(output, group=self.group, async_op=async_op), None, async_op)

    @staticmethod
    def _finish(work: dist.Work | None, then: Callable[[], None] | None, async_op: bool) -> Handle:
        handle = _Then(work if async_op else None, then)
        if not async_op:
            handle.wait()
        return handle
