"""Stage 1: fp32 master weights and optimizer state partitioned 1/N.

Gradients accumulate over the window in a full flat buffer, exactly as in stage 0. In the boundary
backward each completed bucket is reduce-scattered (asynchronously with ``overlap_comm``) straight into
this rank's fp32 partition gradient; the rank steps only its shards, then every bucket is all-gathered
back into the flat parameter buffer (``publish``).
"""

from __future__ import annotations

import torch

from ..layout import BucketKey
from .collectives import Handle
from .stage0 import Stage0, _CopyBack


class Stage1(Stage0):
    stage = 1
    partitioned = True

    always_overlaps = False
    predivides = True
    # A bucket is both the gradient reduction and the all-gather unit of the updated weights here.
    bucket_keys: tuple[str, ...] = ("reduce_bucket_size", "allgather_bucket_size")

    def _allocate(self) -> None:
        super()._allocate()
        self.partition_grads = [
            torch.zeros(gs.layout.partition_numel, dtype=torch.float32, device=gs.device) for gs in self.groups
        ]

    def launch_reduction(self, key: BucketKey) -> Handle:
        g, b = key
        _, send = self._comm_input(key)
        out = self.groups[g].layout.partition_view(self.partition_grads[g], b)
        if send.dtype == out.dtype:
            return self.comm_of(g).reduce_scatter(out, send, async_op=self.options.async_comm)
        temp = torch.empty(out.numel(), dtype=send.dtype, device=out.device)
        return _CopyBack(self.comm_of(g).reduce_scatter(temp, send, async_op=self.options.async_comm), out, temp)

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]:
        return self.groups[group].master_shaped(self.partition_grads[group])

    def reduce_late(self, key: BucketKey, late: torch.Tensor) -> None:
        out = self.groups[key[0]].layout.partition_view(self.partition_grads[key[0]], key[1])
        send = late if self.options.comm_dtype == late.dtype else late.to(self.options.comm_dtype)
        self._reduce_scatter_add(out, send, key[0])

    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        out["grads"] += sum(t.numel() * t.element_size() for t in self.partition_grads)
        return out
