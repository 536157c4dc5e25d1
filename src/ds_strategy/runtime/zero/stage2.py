"""Stage 2: gradients are partitioned too; no rank ever holds the full gradient.

In *every* backward, gradients are copied into a staging buffer of their bucket (``comm_dtype``,
allocated when the bucket's first gradient arrives). A completed bucket is reduce-scattered
(asynchronously with ``overlap_comm``) and its result added into this rank's fp32 partition gradient,
which accumulates the window; the staging buffer is dropped as soon as its collective is done. So a
rank holds its 1/N fp32 partition gradient plus the buckets in flight (``reduce_bucket_size`` bounds
them). The partition gradient is always contiguous (``contiguous_gradients`` is implied).
"""

from __future__ import annotations

import torch

from ..layout import BucketKey
from .base import ZeroStage
from .buffers import GroupStorage
from .collectives import Handle, advance


class Stage2(ZeroStage):
    stage = 2
    partitioned = True
    reduces_every_backward = True

    # A bucket is both the gradient reduction and the all-gather unit of the updated weights here.
    bucket_keys: tuple[str, ...] = ("reduce_bucket_size", "allgather_bucket_size")

    def _allocate(self) -> None:
        self.partition_grads = [self._partition_grad(gs) for gs in self.groups]
        self._staging: dict[BucketKey, torch.Tensor] = {}
        self._grad_places: dict[tuple[int, int], tuple[BucketKey, int, int]] = {}  # see grad_target
        # Buckets whose partition gradient holds nothing of this window yet: the first result is copied
        # in (or reduce-scattered straight into place), later ones are added.
        self._fresh = {key: True for key in self.bucket_order}

    def _partition_grad(self, gs: GroupStorage) -> torch.Tensor:
        """This rank's fp32 gradient partition of one group (stage 3 allocates it lazily)."""
        return torch.zeros(gs.layout.partition_numel, dtype=torch.float32, device=gs.device)

    def _staging_for(self, key: BucketKey) -> torch.Tensor:
        buf = self._staging.get(key)
        if buf is None:
            g, b = key
            bucket = self.groups[g].layout.buckets[b]
            buf = torch.empty(bucket.padded, dtype=self.options.comm_dtype, device=self.groups[g].device)
            for lo, hi in self.groups[g].layout.gaps(b):  # padding: summed by the reduce-scatter, never read
                buf[lo:hi].zero_()
            self._staging[key] = buf
        return buf

    def grad_target(self, group: int, index: int) -> torch.Tensor:
        place = self._grad_places.get((group, index))
        if place is None:  # once per parameter: this runs in every gradient hook
            slot = self.groups[group].layout.params[index]
            start = self.groups[group].layout.buckets[slot.bucket].start
            place = self._grad_places[(group, index)] = ((group, slot.bucket), slot.offset - start, slot.end - start)
        key, lo, hi = place
        return self._staging_for(key)[lo:hi]

    def launch_reduction(self, key: BucketKey) -> Handle:
        g = key[0]
        staging = self._staging_for(key)
        self.intake.consume(key, staging)  # the staging buffer is consumed by this launch
        if self.options.pre_scale != 1.0:
            staging.mul_(self.options.pre_scale)
        fresh = self._fresh[key]
        self._fresh[key] = False
        out = self._partition_out(key, fresh)
        direct = fresh and staging.dtype == out.dtype
        if direct:
            result = out
        elif self._reduces_in_place(g) and staging.numel() == out.numel():
            result = staging  # a group of one: the staging buffer is the reduced shard (no copy into a temporary)
        else:
            result = torch.empty(out.numel(), dtype=staging.dtype, device=out.device)
        handle = self._reduce_scatter(result, staging, group=g, async_op=self.options.async_comm)
        return _Land(self, key, handle, out, None if direct else (result, fresh))

    def _reduces_in_place(self, group: int) -> bool:
        """Whether param group ``group``'s reduce-scatter may write its input (a group of one copies nothing)."""
        return self.comm_of(group).world_size == 1

    def _partition_out(self, key: BucketKey, fresh: bool) -> torch.Tensor:
        """Where bucket ``key``'s reduced shard lands (holding this window's earlier ones unless ``fresh``)."""
        return self.groups[key[0]].layout.partition_view(self.partition_grads[key[0]], key[1])

    def land(self, key: BucketKey, out: torch.Tensor | None) -> None:
        """Bucket ``key``'s reduction is in: ``out`` (None once reported) is final, its staging buffer goes."""
        if out is not None:
            self._landed(key, out)
        self._staging.pop(key, None)

    def _landed(self, key: BucketKey, out: torch.Tensor) -> None:
        """Bucket ``key``'s shard in ``out`` is final for this backward (stage 3's NVMe offload writes it)."""

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]:
        return self.groups[group].master_shaped(self.partition_grads[group])

    def late_buffer(self, key: BucketKey) -> torch.Tensor:
        bucket = self.groups[key[0]].layout.buckets[key[1]]
        return torch.zeros(bucket.padded, dtype=self.options.comm_dtype, device=self.groups[key[0]].device)

    def reduce_late(self, key: BucketKey, late: torch.Tensor) -> None:
        out = self._partition_out(key, False)
        self._reduce_scatter_add(out, late, key[0])
        self._landed(key, out)

    def _reset_window(self) -> None:
        self._fresh = dict.fromkeys(self.bucket_order, True)
        self._staging.clear()

    def memory_bytes(self) -> dict[str, int]:
        out = super().memory_bytes()
        out["grads"] += sum(t.numel() * t.element_size() for t in self.partition_grads)
        out["grads"] += sum(t.numel() * t.element_size() for t in self._staging.values())
        return out


class _Land:
    """Finish one bucket: wait, fold the shard into the partition gradient, free the staging buffer."""

    def __init__(
        self,
        stage: Stage2,
        key: BucketKey,
        handle: Handle,
        out: torch.Tensor,
        fold: tuple[torch.Tensor, bool] | None,
    ) -> None:
        self._stage, self._key, self._handle, self._out, self._fold = stage, key, handle, out, fold

    def wait(self) -> None:
        self._handle.wait()
        if self._fold is not None:
            result, fresh = self._fold
            if fresh:
                self._out.copy_(result)
            else:
                self._out.add_(result)
            self._fold = None
        out, self._out = self._out, None  # type: ignore[assignment]
        self._stage.land(self._key, out)

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def advance(self) -> None:
        advance(self._handle)
