"""Stage 0: replicated weights, optimizer and gradients; a bucketed all-reduce that overlaps backward.

Gradients accumulate over the window in one full flat buffer per param group (``accum_dtype``). In the
boundary backward each bucket is all-reduced asynchronously as soon as it is complete, so communication
runs while autograd computes the earlier layers. Every rank then steps the same full fp32 masters (the
flat parameter buffer itself in fp32) and no gather is needed.
"""

from __future__ import annotations

import torch

from ..layout import BucketKey
from .base import ZeroStage
from .collectives import Handle


class Stage0(ZeroStage):
    stage = 0
    partitioned = False

    always_overlaps = True  # the all-reduces always overlap backward (DDP's behaviour; overlap_comm is ZeRO's key)
    predivides = False  # DeepSpeed's stage 0 sums, then averages

    def _allocate(self) -> None:
        # Zero-initialised so bucket padding (never written) reduces as zeros.
        dtype = self.options.accum_dtype
        self.accum = [torch.zeros(gs.layout.total, dtype=dtype, device=gs.device) for gs in self.groups]

    def grad_target(self, group: int, index: int) -> torch.Tensor:
        return self.groups[group].layout.param_view(self.accum[group], index)

    def _comm_input(self, key: BucketKey) -> tuple[torch.Tensor, torch.Tensor]:
        """(the bucket of the accumulation buffer, the tensor to communicate: it, or a cast copy), pre-scaled."""
        g, b = key
        bucket = self.groups[g].layout.bucket_view(self.accum[g], b)
        self.intake.zero_unwritten(key, bucket)
        send = bucket if self.options.comm_dtype == bucket.dtype else bucket.to(self.options.comm_dtype)
        if self.options.pre_scale != 1.0:
            send.mul_(self.options.pre_scale)
        return bucket, send

    def launch_reduction(self, key: BucketKey) -> Handle:
        bucket, send = self._comm_input(key)
        handle = self.comm_of(key[0]).all_reduce(send, async_op=self.options.async_comm)
        if send is bucket:
            return handle
        return _CopyBack(handle, bucket, send)

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]:
        return self.groups[group].master_shaped(self.accum[group])

    def late_buffer(self, key: BucketKey) -> torch.Tensor:
        g, b = key
        return torch.zeros_like(self.groups[g].layout.bucket_view(self.accum[g], b))

    def reduce_late(self, key: BucketKey, late: torch.Tensor) -> None:
        g, b = key
        bucket = self.groups[g].layout.bucket_view(self.accum[g], b)
        send = late if self.options.comm_dtype == late.dtype else late.to(self.options.comm_dtype)
        if self.options.pre_scale != 1.0:
            send.mul_(self.options.pre_scale)
        self.comm_of(g).all_reduce(send)
        bucket.add_(send.to(bucket.dtype))

    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        out["grads"] += sum(a.numel() * a.element_size() for a in self.accum)
        return out


class _CopyBack:
    """Wait for a collective on a cast copy, then write the result back into the original buffer."""

    def __init__(self, handle: Handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._handle, self._dst, self._src = handle, dst, src

    def wait(self) -> None:
        self._handle.wait()
        self._dst.copy_(self._src)

    def is_completed(self) -> bool:
        return self._handle.is_completed()
