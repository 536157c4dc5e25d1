"""Where this rank's compute-dtype partition of a stage-3 param group rests, and how it reaches a gather.

A ``ShardedGroup`` ([Note: storage swap] in sharded.py) owns the bucket-sized gathered tensors; the
partition they are gathered from is this object's: one host or device buffer (``part``, one view per
bucket in ``views``), or per bucket the NVMe swap file ([Note: swapped partitions]), or int8 shards
(ZeRO++'s zero_quantized_nontrainable_weights, [Note: ZeRO++] in zeropp.py), plus hpZ's secondary copies
(this rank's 1/h slice of a bucket, for gathers inside the node group). ``read`` and ``write`` reach a
bucket's partition wherever it rests; ``materialize`` brings the whole of it into one ``part`` buffer for
a while (checkpoints, full-state access); ``gather_into`` all-gathers a bucket from it.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ds_strategy.ops.quant import Quantized, dequantize_into

from ..layout import FlatLayout
from ..swap import PartitionSwapper
from .collectives import Collectives, Handle
from .zeropp import ZeroPP, quantize_shard, quantized_all_gather, then


class PartitionRest:
    """This rank's compute-dtype partition of one stage-3 param group, wherever it rests."""

    def __init__(
        self,
        index: int,
        layout: FlatLayout,
        *,
        coll: Collectives,
        persistent: Collection[int],
        compute_dtype: torch.dtype,
        device: torch.device,
        pin: bool,
        swap: PartitionSwapper | None,
        keep_in_cpu: int,
        zeropp: ZeroPP | None,
        frozen: bool,
    ) -> None:
        self.index = index  # the group's: the swap file's keys are (group, bucket)
        self.layout = layout
        self.coll = coll
        self.compute_dtype = compute_dtype
        self.device = device  # where the partition rests when in memory (offload_param's device)
        self.swap = swap
        self.numels = [b.padded // coll.world_size for b in layout.buckets]  # one bucket's shard each
        self._qrest: list[Quantized] | None = None  # int8 frozen partitions ([Note: ZeRO++] in zeropp.py)
        self._rest_version = 0
        self._materialized = 0
        self._kept: list[torch.Tensor] = []
        self.hpz = zeropp.hpz if zeropp is not None else None
        self.secondary: dict[int, torch.Tensor] = {}  # bucket -> this rank's 1/h slice of it (hpZ)
        self.quantized_gather = zeropp is not None and (
            zeropp.quantized_weights or (frozen and zeropp.quantized_frozen)
        )
        # NVMe offload: which buckets' partitions rest in the swap file ([Note: swapped partitions]).
        self.swapped = self._choose_swapped(persistent, keep_in_cpu) if swap is not None else set()
        if self.swapped:
            self.part = torch.empty(0, dtype=compute_dtype, device=device)
            self.views = [
                torch.empty(0 if b in self.swapped else n, dtype=compute_dtype, device=device, pin_memory=pin)
                for b, n in enumerate(self.numels)
            ]
        else:
            self.part = torch.empty(layout.partition_numel, dtype=compute_dtype, device=device, pin_memory=pin)
            self.views = layout.partition_views(self.part)

    def _choose_swapped(self, persistent: Collection[int], keep_in_cpu: int) -> set[int]:
        """[Note: swapped partitions] With offload_param on NVMe, persistent buckets (gathered for good) and
        the first ``max_in_cpu`` partition elements in layout order stay in host memory, as in DeepSpeed;
        every other bucket's partition rests in the swap file and is read when the bucket is gathered."""
        swapped, budget = set(), keep_in_cpu
        for b, n in enumerate(self.numels):
            if b in persistent:
                continue
            if n <= budget:
                budget -= n
            else:
                swapped.add(b)
        return swapped

    def rest_int8(self) -> None:
        """ZeRO++'s zero_quantized_nontrainable_weights: from now on the (built) partitions rest as int8."""
        if self.swapped:
            raise ValueError(
                "zero_optimization.zero_quantized_nontrainable_weights cannot be combined with offload_param "
                "on nvme (the frozen partitions rest in the swap file); use offload_param cpu or none"
            )
        self._qrest = [quantize_shard(view) for view in self.views]
        self.part = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self.views = [self.part] * len(self._qrest)

    @property
    def quantized(self) -> bool:
        """The partitions rest as int8 (``rest_int8``)."""
        return self._qrest is not None

    def in_swap_file(self, bucket: int) -> bool:
        """The bucket's partition is in the swap file now (not materialized)."""
        return bucket in self.swapped and not self._materialized

    # ------------------------------------------------------------------ gathers from the partition
    def needs_compute_stream(self, bucket: int, exact: bool) -> bool:
        """Gathers whose temporaries outlive the issue (ZeRO++'s int8 buffers, dequantized at wait; hpZ's
        secondary copy) or that read the swap file stay on the compute stream: the gather stream's memory
        would be handed back to it while the compute stream still reads it."""
        quantized = not exact and self.quantized_gather and self.coll.world_size > 1
        return quantized or self.hpz is not None or bucket in self.swapped

    def gather_into(self, full: torch.Tensor, bucket: int, *, async_op: bool, tag: int, exact: bool) -> Handle:
        """All-gather ``bucket`` into its bucket-sized tensor ``full`` (see ``ShardedGroup.gather``)."""
        if exact:
            mine = full.view(self.coll.world_size, -1)[self.coll.rank]
            self.read(bucket, mine, trace=True)
            return self.coll.all_gather(full, mine, async_op=async_op, tag=tag)
        if self.hpz is not None and bucket in self.secondary:  # hpZ: inside the node group only
            mine = full.view(self.hpz.world_size, -1)[self.hpz.rank]
            mine.copy_(self.secondary[bucket])
            return self.hpz.all_gather(full, mine, async_op=async_op, tag=tag)
        if self.quantized_gather and self.coll.world_size > 1:  # one rank: nothing travels, nothing to quantize
            if self._qrest is not None and not self._materialized:
                shard = self._qrest[bucket]
            else:
                part = torch.empty(full.numel() // self.coll.world_size, dtype=full.dtype, device=full.device)
                self.read(bucket, part, trace=True)
                shard = quantize_shard(part)
            handle = quantized_all_gather(self.coll, full, shard, async_op=async_op, tag=tag)
        else:
            mine = full.view(self.coll.world_size, -1)[self.coll.rank]
            self.read(bucket, mine, trace=True)
            handle = self.coll.all_gather(full, mine, async_op=async_op, tag=tag)
        if self.hpz is None:
            return handle
        return then(handle, lambda: self._keep_secondary(bucket, full))

    def _keep_secondary(self, bucket: int, full: torch.Tensor) -> None:
        """hpZ: keep this rank's slice of the freshly gathered bucket for the next gathers."""
        assert self.hpz is not None
        self.secondary[bucket] = full.view(self.hpz.world_size, -1)[self.hpz.rank].clone()

    def drop_secondaries(self) -> None:
        """The parameters changed (a step, an edit, a load): the next gather goes to the primary partitions."""
        self.secondary.clear()

    # ------------------------------------------------------------------ partitions, wherever they rest
    def resident(self, bucket: int) -> torch.Tensor | None:
        """This rank's partition of ``bucket`` as the compute-dtype tensor itself, where it rests in memory and
        a gather reads it as it is (not from the swap file, int8 shards, qwZ or hpZ copies); else None."""
        if self._qrest is not None or self.hpz is not None or self.quantized_gather:
            return None
        if bucket in self.swapped and not self._materialized:
            return None
        return self.views[bucket]

    def read(self, bucket: int, out: torch.Tensor, *, trace: bool = False) -> None:
        """Copy this rank's compute-dtype partition of ``bucket`` into ``out`` (from the swap file when it
        rests there; ``trace``: a gather, whose order the read-ahead learns)."""
        if self._qrest is not None and not self._materialized:
            dequantize_into(self._qrest[bucket], out)
            return
        if bucket in self.swapped and not self._materialized:
            assert self.swap is not None
            if trace:
                self.swap.load((self.index, bucket), out)
            else:
                self.swap.fetch((self.index, bucket), out)
        elif out.data_ptr() != self.views[bucket].data_ptr():  # in place: already there
            out.copy_(self.views[bucket], non_blocking=True)

    def write(self, bucket: int, value: torch.Tensor) -> None:
        """Make ``value`` (any float dtype) this rank's partition of ``bucket``."""
        self.secondary.pop(bucket, None)
        if self._qrest is not None and not self._materialized:
            self._qrest[bucket] = quantize_shard(value.to(self.compute_dtype).contiguous())
            return
        if bucket in self.swapped and not self._materialized:
            assert self.swap is not None
            self.swap.store((self.index, bucket), value)
        elif value.data_ptr() != self.views[bucket].data_ptr() or value.dtype != self.compute_dtype:
            self.views[bucket].copy_(value)

    def materialize(self) -> None:
        """The whole partition in host memory as one ``part`` buffer, as without NVMe (``resident``)."""
        self._materialized += 1
        if self._materialized == 1 and self._qrest is not None:  # int8 frozen partitions, dequantized
            self.part = torch.empty(self.layout.partition_numel, dtype=self.compute_dtype, device=self.device)
            self.views = self.layout.partition_views(self.part)
            for view, qt in zip(self.views, self._qrest, strict=True):
                dequantize_into(qt, view)
            self._rest_version = self.part._version
            return
        if self._materialized > 1 or not self.swapped:
            return
        part = torch.empty(self.layout.partition_numel, dtype=self.compute_dtype, device=self.device)
        views = self.layout.partition_views(part)
        for b, view in enumerate(views):
            if b in self.swapped:
                assert self.swap is not None
                self.swap.fetch((self.index, b), view)
            else:
                view.copy_(self.views[b])
        self._kept, self.part, self.views = self.views, part, views

    def dematerialize(self) -> None:
        self._materialized -= 1
        if self._materialized == 0 and self._qrest is not None:
            if self.part._version != self._rest_version:  # written meanwhile (a load): quantize it again
                self._qrest = [quantize_shard(view) for view in self.views]
                self.secondary.clear()
            self.part = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            self.views = [self.part] * len(self._qrest)
            return
        if self._materialized > 0 or not self.swapped:
            return
        views, kept = self.views, self._kept
        for b, view in enumerate(views):
            if b in self.swapped:
                assert self.swap is not None
                self.swap.store((self.index, b), view)
            else:
                kept[b].copy_(view)
        self.views, self.part = kept, torch.empty(0, dtype=self.compute_dtype, device=self.device)

    def nbytes(self) -> int:
        """Bytes the partition holds in memory: the buffer (or the buckets' kept in memory), int8 shards at
        rest and hpZ's secondaries."""
        held = sum(t.numel() * t.element_size() for t in self.secondary.values())
        if self._qrest is not None and not self._materialized:
            held += sum(qt.nbytes for qt in self._qrest)
        part = self.part.numel() if not self.swapped or self._materialized else sum(v.numel() for v in self.views)
        return part * self.part.element_size() + held
