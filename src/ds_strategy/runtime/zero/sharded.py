"""Stage 3's storage of one param group: the compute-dtype parameters exist only as this rank's shards.

[Note: storage swap]
Stage 3 keeps, per param group, a *partition* buffer in the compute dtype: this rank's shard of every
bucket of the flat layout (the same layout as stages 1-2, so masters, gradients and optimizer state are
sharded exactly as there). Each bucket also owns one full-size *gathered* tensor whose storage is
allocated only while the bucket is live: ``gather`` gives its storage the padded bucket's bytes (from the
host pool on CPU: [Note: gathered buckets and host memory]), copies this rank's shard in and all-gathers
the rest; ``free`` takes the bytes back, leaving a 0-byte storage. The tensor
object itself (and therefore every view of it) survives, which is what makes freeing safe: autograd
saves views of weights for backward (``linear`` saves ``weight.t()``), and those saved views point into
this same storage, so re-gathering before a module's backward refills exactly what they read (the FSDP
technique). While a bucket is live its parameters' ``.data`` are views of the gathered tensor; while it
is free they are 0-element placeholders, so a stray use outside the hooks fails loudly on a shape
instead of reading freed memory.

Parameters below ``stage3_param_persistence_threshold`` sit in buckets of their own that are gathered
once and never freed (persistent): they behave like stage 2 parameters.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from ds_strategy.ops.quant import Quantized, dequantize_into

from .. import host_memory
from ..layout import FlatLayout, ParamSlot
from ..swap import OptimizerSwapper, PartitionSwapper
from .buffers import GroupStorage
from .collectives import DONE, Collectives, Handle
from .init import gather_init_param, init_shard, release_init_shard
from .streams import GatherStream
from .zeropp import ZeroPP, quantize_shard, quantized_all_gather, then

BUILD_CHUNK = 1 << 22  # elements: the most of a bucket the build holds in fp32 scratch at once (16 MiB)


class ShardedGroup(GroupStorage):
    """Partition buffer, per-bucket gathered tensors and fp32 masters of one param group (stage 3).

    The ``GroupStorage`` the stage machinery and checkpoints use (``layout``, ``params``, ``masters``,
    ``master_shaped``, ``copy_masters_to_params``, ``numel_bytes``); nothing full-size is kept.
    """

    # [Note: a group of one gathers in place]; tests measuring world size 1 as a rank of a larger group
    # gathers (a memory baseline with the same working set) set it False.
    GATHER_IN_PLACE: bool = True

    def __init__(
        self,
        index: int,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        coll: Collectives,
        bucket_numel: int,
        breaks: Collection[int],
        persistent: Collection[int],
        compute_dtype: torch.dtype,
        master_device: torch.device,
        param_device: torch.device,
        device: torch.device | None = None,
        pin_memory: bool = False,
        pin_part: bool = False,
        frozen: bool = False,
        param_swap: PartitionSwapper | None = None,
        master_swap: OptimizerSwapper | None = None,
        keep_in_cpu: int = 0,
        zeropp: ZeroPP | None = None,
    ) -> None:
        self.index = index
        self._qrest: list[Quantized] | None = None  # int8 frozen partitions ([Note: ZeRO++] in zeropp.py)
        self.hpz = zeropp.hpz if zeropp is not None else None
        self.secondary: dict[int, torch.Tensor] = {}  # bucket -> this rank's 1/h slice of it (hpZ)
        self._rest_version = 0
        self.frozen = frozen  # parameters nobody trains: no masters, gradients or optimizer state
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.partitioned = True
        self.rank = coll.rank
        self.coll = coll
        self.layout = FlatLayout.build(
            [(n, p.shape if init_shard(p) is None else init_shard(p).shape, p.dtype) for n, p in named_params],  # type: ignore[union-attr]
            world_size=coll.world_size,
            bucket_numel=bucket_numel,
            breaks=breaks,
        )
        # The compute device: where gathered buckets live. A CPU-built module's trainable parameters are
        # not moved there whole by the engine: each bucket goes over in turn below.
        self.device = device or _compute_device(self.params)
        self.compute_dtype = compute_dtype
        self.persistent = {b.index for b in self.layout.buckets if all(i in persistent for i in b.params)}
        # offload_param.pin_memory pins the host partition (parameter-only offload too); pin_memory is the
        # optimizer offload's, for the fp32 masters.
        pin = pin_part and param_device.type == "cpu" and torch.cuda.is_available()
        self.param_swap = param_swap
        self.master_swap = None if frozen else master_swap
        self._param_device = param_device
        self._materialized = 0
        # NVMe offload: which buckets' partitions rest in the swap file ([Note: swapped partitions]).
        self.swapped = self._choose_swapped(keep_in_cpu) if param_swap is not None else set()
        if self.swapped:
            self.part = torch.empty(0, dtype=compute_dtype, device=param_device)
            self._part_views = [
                torch.empty(0 if b in self.swapped else n, dtype=compute_dtype, device=param_device, pin_memory=pin)
                for b, n in enumerate(self._shard_numels())
            ]
        else:
            self.part = torch.empty(
                self.layout.partition_numel, dtype=compute_dtype, device=param_device, pin_memory=pin
            )
            self._part_views = self.layout.partition_views(self.part)
        swapping = param_swap is not None or self.master_swap is not None
        self.aliased = compute_dtype == torch.float32 and master_device == param_device and not swapping
        if self.aliased or frozen:
            self.master_flat: torch.Tensor | None = None
        elif self.master_swap is not None:
            self.master_flat = torch.empty(0, dtype=torch.float32, device=master_device)
        else:
            self.master_flat = torch.empty(
                self.layout.partition_numel, dtype=torch.float32, device=master_device, pin_memory=pin_memory
            )
        if self.master_flat is None:
            master_views = self._part_views
        elif self.master_swap is not None:
            master_views = []  # written straight to the swap file by _take_bucket
        else:
            master_views = self.layout.partition_views(self.master_flat)
        if frozen:
            self.aliased = False
        # Built one bucket at a time: beyond this rank's partition, only one full-size bucket (in fp32,
        # plus its compute-dtype twin when persistent) exists at once, and each parameter's original
        # storage is dropped as soon as its bucket is partitioned.
        self.full: list[torch.Tensor] = []
        self._param_views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # see _point_params
        self.live: list[bool] = []
        self._live_numel = 0
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=self.device)
        # Three scratch buffers serve every bucket (a chunk of the bucket in fp32, this rank's fp32 shard where
        # it cannot be assembled in place, one gathered zero.Init parameter): per-bucket temporaries of
        # alternating lifetimes would fragment the host heap, which then keeps about the whole model resident
        # (measured with MALLOC_PERTURB_: 2.5x the model instead of 0.6x). The chunk bounds the build's
        # scratch whatever the bucket: a block unit's bucket (the rest of a model: embeddings and head) can be
        # a large part of the model, which every rank still holds whole while it is being partitioned.
        longest = max((b.padded for b in self.layout.buckets), default=0)
        scratch32 = torch.empty(min(longest, BUILD_CHUNK), dtype=torch.float32, device=self.device)
        shard32 = _LazyBuffer(torch.float32, self.device)
        gathered = max((s.per * coll.world_size for s in map(init_shard, self.params) if s is not None), default=0)
        gather_buf = torch.empty(gathered, dtype=torch.float32, device=self.device) if gathered else None
        freed = 0  # bytes of original parameter storage dropped since the last heap trim
        for b in range(len(self.layout.buckets)):
            freed += self._take_bucket(b, scratch32, shard32, gather_buf, master_views)
            if self.device.type == "cpu" and freed >= BUILD_CHUNK * 4:
                # glibc keeps freed mid-sized blocks in its heap, so without a trim the build's peak is the
                # whole model plus every partition taken so far; a trim costs milliseconds, so once a chunk's
                # worth of parameters is gone, not after every (possibly tiny) bucket.
                host_memory.trim_heap()
                freed = 0
        del scratch32, shard32, gather_buf
        for b, bucket in enumerate(self.layout.buckets):
            if b not in self.persistent:  # a bucket-sized tensor without storage, filled by gather()
                self.full[b] = torch.empty(bucket.padded, dtype=compute_dtype, device=self.device)
                host_memory.release(self.full[b])
        # ZeRO++ ([Note: ZeRO++] in zeropp.py): quantized gathers, int8 frozen partitions, hpZ secondaries.
        self.zeropp = zeropp
        self.quantized_gather = zeropp is not None and (
            zeropp.quantized_weights or (frozen and zeropp.quantized_frozen)
        )
        if zeropp is not None and frozen and zeropp.quantized_frozen:
            if self.swapped:
                raise ValueError(
                    "zero_optimization.zero_quantized_nontrainable_weights cannot be combined with offload_param "
                    "on nvme (the frozen partitions rest in the swap file); use offload_param cpu or none"
                )
            self._qrest = [quantize_shard(view) for view in self._part_views]
            self.part = torch.empty(0, dtype=compute_dtype, device=param_device)
            self._part_views = [self.part] * len(self._qrest)
        self.in_place = self._gather_in_place(coll.world_size)
        # One leaf per bucket for the optimizer (see [Note: master weights] in buffers.py); none when frozen.
        if frozen:
            self.masters: list[nn.Parameter] = []
        elif self.master_swap is not None:  # NVMe: the masters rest in the swap file (written by _take_bucket)
            self.masters = [nn.Parameter(torch.empty(0, device=master_device)) for _ in self.layout.buckets]
            for b, (master, n) in enumerate(zip(self.masters, self._shard_numels(), strict=True)):
                self.master_swap.bind(master, (index, b), n)
        else:
            self.masters = [nn.Parameter(piece) for piece in master_views]

    def _shard_numels(self) -> list[int]:
        return [b.padded // self.coll.world_size for b in self.layout.buckets]

    def _choose_swapped(self, keep_in_cpu: int) -> set[int]:
        """[Note: swapped partitions] With offload_param on NVMe, persistent buckets (gathered for good) and
        the first ``max_in_cpu`` partition elements in layout order stay in host memory, as in DeepSpeed;
        every other bucket's partition rests in the swap file and is read when the bucket is gathered."""
        swapped, budget = set(), keep_in_cpu
        for b, n in enumerate(self._shard_numels()):
            if b in self.persistent:
                continue
            if n <= budget:
                budget -= n
            else:
                swapped.add(b)
        return swapped

    @torch.no_grad()
    def _take_bucket(
        self,
        b: int,
        scratch32: torch.Tensor,
        shard32: _LazyBuffer,
        gather_buf: torch.Tensor | None,
        master_views: list[torch.Tensor],
    ) -> int:
        """Build bucket ``b`` in fp32 (exact for every input dtype), one chunk of ``scratch32`` at a time, and
        keep this rank's shard of it. Rank 0's values win, as in stages 0-2; parameters built under zero.Init
        are already agreed: gathered, not broadcast, and their zero.Init shards dropped once taken. Returns
        the bytes of parameter storage it dropped."""
        bucket = self.layout.buckets[b]
        per = bucket.padded // self.coll.world_size
        lo, hi = self.rank * per, (self.rank + 1) * per  # this rank's shard, in bucket coordinates
        mine = self._shard_target(b, per, shard32, master_views)
        whole = (
            torch.empty(bucket.padded, dtype=self.compute_dtype, device=self.device) if b in self.persistent else None
        )
        source: tuple[int, torch.Tensor] | None = None  # the flattened parameter being copied (spans chunks)
        dropped = 0
        step = max(scratch32.numel(), 1)
        for c0 in range(0, bucket.padded, step):
            c1 = min(c0 + step, bucket.padded)
            chunk = scratch32[: c1 - c0].zero_()
            from_init = True
            for i in bucket.params:
                slot = self.layout.params[i]
                s0, s1 = slot.offset - bucket.start, slot.end - bucket.start
                a, z = max(s0, c0), min(s1, c1)
                if a >= z:
                    continue
                p = self.params[i]
                info = init_shard(p)
                if source is None or source[0] != i:
                    if info is not None:
                        out = gather_buf if gather_buf is not None and info.dtype == torch.float32 else None
                        source = (i, gather_init_param(p, out=out).reshape(-1))
                    else:
                        source = (i, p.detach().reshape(-1))
                chunk[a - c0 : z - c0].copy_(source[1][a - s0 : z - s0])
                if info is None:
                    from_init = False
                if z == s1:  # the parameter is all in the scratch now: its own storage can go
                    release_init_shard(p)  # the partition below replaces zero.Init's shard (if any)
                    dropped += info.shard.nbytes if info is not None else p.numel() * p.element_size()
                    p.data = self._placeholder
                    source = None
            if not from_init:
                self.coll.broadcast(chunk)
            a, z = max(c0, lo), min(c1, hi)
            if a < z:
                mine[a - lo : z - lo].copy_(chunk[a - c0 : z - c0])
            if whole is not None:
                whole[c0:c1].copy_(chunk)
        if mine is not self._part_views[b]:
            self.write_part(b, mine)
        if self.master_swap is not None:
            self.master_swap.store((self.index, b), mine)
        elif master_views is not self._part_views and mine is not master_views[b]:
            master_views[b].copy_(mine)
        if whole is not None:
            self.full.append(whole)
            self.live.append(True)
            self._point_params(b)
        else:
            self.full.append(self._placeholder)  # given its own tensor once the scratch buffers are gone
            self.live.append(False)
        return dropped

    def _gather_in_place(self, world_size: int) -> set[int]:
        """[Note: a group of one gathers in place] With one rank, a bucket's partition is the whole bucket:
        its gather would copy the partition into a bucket-sized tensor of the same values. So where the
        partition rests on the compute device in the compute dtype (no parameter offload, no swap file, no
        int8 rest), the bucket's gathered tensor *is* the partition: a gather points the parameters into
        it and counts it live, a free points them away; nothing is allocated or copied, and the hooks,
        prefetch and live limits run as at any world size. A step's update of the partition is what the
        parameters read next."""
        resting_elsewhere = self._qrest is not None or self.swapped or self._param_device != self.device
        if not self.GATHER_IN_PLACE or world_size != 1 or self.hpz is not None or resting_elsewhere:
            return set()
        chosen = set()
        for b, bucket in enumerate(self.layout.buckets):
            view = self._part_views[b]
            if b not in self.persistent and view.numel() == bucket.padded and view.dtype == self.compute_dtype:
                self.full[b] = view
                chosen.add(b)
        return chosen

    def _shard_target(self, b: int, per: int, shard32: _LazyBuffer, master_views: list[torch.Tensor]) -> torch.Tensor:
        """Where bucket ``b``'s fp32 shard is assembled: in place (the fp32 master, or an fp32 partition the
        plain way), else in the shared scratch shard."""
        if self.master_swap is None and master_views is not self._part_views:
            return master_views[b]
        view = self._part_views[b]
        if view.dtype == torch.float32 and view.numel() == per and b not in self.swapped:
            return view
        return shard32.get(per)

    # ------------------------------------------------------------------ views
    def slot(self, index: int) -> ParamSlot:
        return self.layout.params[index]

    def in_bucket(self, bucket_tensor: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s place in a bucket-sized tensor, shaped like the parameter."""
        slot = self.layout.params[index]
        start = self.layout.buckets[slot.bucket].start
        return bucket_tensor[slot.offset - start : slot.end - start].view(slot.shape)

    def _point_params(self, bucket: int) -> None:
        # A bucket's gathered tensor keeps its storage object across gathers (only the bytes behind it come
        # and go), so the parameters' views of it are made once per tensor, not sliced again every fetch.
        full = self.full[bucket]
        cached = self._param_views.get(bucket)
        if cached is None or cached[0] is not full:
            cached = self._param_views[bucket] = (
                full,
                [self.in_bucket(full, i) for i in self.layout.buckets[bucket].params],
            )
        for i, view in zip(self.layout.buckets[bucket].params, cached[1], strict=True):
            self.params[i].data = view

    # ------------------------------------------------------------------ gather / free (see the note)
    def gather(
        self, bucket: int, *, async_op: bool, tag: int = 0, exact: bool = False, stream: GatherStream | None = None
    ) -> Handle:
        """Allocate the bucket's gathered tensor and all-gather it; the parameters point into it at once.
        ``exact``: from the primary partitions, unquantized (GatheredParameters, full state dicts);
        ``stream``: issue the device work on the gather stream ([Note: gather stream] in streams.py)."""
        if self.live[bucket]:
            return DONE
        full = self.full[bucket]
        in_place = bucket in self.in_place  # [Note: a group of one gathers in place]
        if not in_place:
            host_memory.allocate(full)  # on the compute stream: see the note
        self.live[bucket] = True
        self._live_numel += full.numel()  # persistent buckets are always live: never gathered here
        self._point_params(bucket)
        if in_place:  # the parameters point into the partition: nothing to copy, nothing to gather
            return DONE
        if stream is None or self._compute_stream_only(bucket, exact):
            return self._gather_into(full, bucket, async_op=async_op, tag=tag, exact=exact)
        with stream.issue():
            return stream.ordered(self._gather_into(full, bucket, async_op=async_op, tag=tag, exact=exact))

    def _compute_stream_only(self, bucket: int, exact: bool) -> bool:
        """Gathers whose temporaries outlive the issue (ZeRO++'s int8 buffers, dequantized at wait; hpZ's
        secondary copy) or that read the swap file stay on the compute stream: the gather stream's memory
        would be handed back to it while the compute stream still reads it."""
        quantized = not exact and self.quantized_gather and self.coll.world_size > 1
        return quantized or self.hpz is not None or bucket in self.swapped

    def _gather_into(self, full: torch.Tensor, bucket: int, *, async_op: bool, tag: int, exact: bool) -> Handle:
        if exact:
            mine = full.view(self.coll.world_size, -1)[self.rank]
            self.read_part(bucket, mine, trace=True)
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
                self.read_part(bucket, part, trace=True)
                shard = quantize_shard(part)
            handle = quantized_all_gather(self.coll, full, shard, async_op=async_op, tag=tag)
        else:
            mine = full.view(self.coll.world_size, -1)[self.rank]
            self.read_part(bucket, mine, trace=True)
            handle = self.coll.all_gather(full, mine, async_op=async_op, tag=tag)
        if self.hpz is None:
            return handle
        return then(handle, lambda: self._keep_secondary(bucket))

    @property
    def quantized_rest(self) -> bool:
        """The partitions rest as int8 (zero_quantized_nontrainable_weights on a frozen storage)."""
        return self._qrest is not None

    def _keep_secondary(self, bucket: int) -> None:
        """hpZ: keep this rank's slice of the freshly gathered bucket for the next gathers (see the note)."""
        assert self.hpz is not None
        self.secondary[bucket] = self.full[bucket].view(self.hpz.world_size, -1)[self.hpz.rank].clone()

    def drop_secondaries(self) -> None:
        """The parameters changed (a step, an edit, a load): the next gather goes to the primary partitions."""
        self.secondary.clear()

    def free(self, bucket: int) -> None:
        """Drop the bucket's gathered storage (persistent buckets stay)."""
        if bucket in self.persistent or not self.live[bucket]:
            return
        for i in self.layout.buckets[bucket].params:
            self.params[i].data = self._placeholder
        if bucket not in self.in_place:  # an in-place bucket's storage is the partition: it stays
            host_memory.release(self.full[bucket])
        self.live[bucket] = False
        self._live_numel -= self.full[bucket].numel()

    def write_back(self, bucket: int) -> None:
        """After an edit of the gathered (live) bucket on every rank: keep this rank's shard of it as the new
        compute-dtype partition and fp32 master (used by GatheredParameters)."""
        mine = self.full[bucket].view(self.coll.world_size, -1)[self.rank]
        self.write_part(bucket, mine)
        if self.master_swap is not None and not self.master_swap.resident:
            self.master_swap.store((self.index, bucket), mine)
        elif self.master_flat is not None:
            self.masters[bucket].data.copy_(mine)

    # ------------------------------------------------------------------ partitions, wherever they rest
    def read_part(self, bucket: int, out: torch.Tensor, *, trace: bool = False) -> None:
        """Copy this rank's compute-dtype partition of ``bucket`` into ``out`` (from the swap file when it
        rests there; ``trace``: a gather, whose order the read-ahead learns)."""
        if self._qrest is not None and not self._materialized:
            dequantize_into(self._qrest[bucket], out)
            return
        if bucket in self.swapped and not self._materialized:
            assert self.param_swap is not None
            if trace:
                self.param_swap.load((self.index, bucket), out)
            else:
                self.param_swap.fetch((self.index, bucket), out)
        elif out.data_ptr() != self._part_views[bucket].data_ptr():  # in place: already there
            out.copy_(self._part_views[bucket], non_blocking=True)

    def write_part(self, bucket: int, value: torch.Tensor) -> None:
        """Make ``value`` (any float dtype) this rank's partition of ``bucket``."""
        self.secondary.pop(bucket, None)
        if self._qrest is not None and not self._materialized:
            self._qrest[bucket] = quantize_shard(value.to(self.compute_dtype).contiguous())
            return
        if bucket in self.swapped and not self._materialized:
            assert self.param_swap is not None
            self.param_swap.store((self.index, bucket), value)
        elif value.data_ptr() != self._part_views[bucket].data_ptr() or value.dtype != self.compute_dtype:
            self._part_views[bucket].copy_(value)

    def materialize(self) -> None:
        """The whole partition in host memory as one ``part`` buffer, as without NVMe (``resident``)."""
        self._materialized += 1
        if self._materialized == 1 and self._qrest is not None:  # int8 frozen partitions, dequantized
            self.part = torch.empty(self.layout.partition_numel, dtype=self.compute_dtype, device=self._param_device)
            self._part_views = self.layout.partition_views(self.part)
            for view, qt in zip(self._part_views, self._qrest, strict=True):
                dequantize_into(qt, view)
            self._rest_version = self.part._version
            return
        if self._materialized > 1 or not self.swapped:
            return
        part = torch.empty(self.layout.partition_numel, dtype=self.compute_dtype, device=self._param_device)
        views = self.layout.partition_views(part)
        for b, view in enumerate(views):
            if b in self.swapped:
                assert self.param_swap is not None
                self.param_swap.fetch((self.index, b), view)
            else:
                view.copy_(self._part_views[b])
        self._kept, self.part, self._part_views = self._part_views, part, views

    def dematerialize(self) -> None:
        self._materialized -= 1
        if self._materialized == 0 and self._qrest is not None:
            if self.part._version != self._rest_version:  # written meanwhile (a load): quantize it again
                self._qrest = [quantize_shard(view) for view in self._part_views]
                self.secondary.clear()
            self.part = torch.empty(0, dtype=self.compute_dtype, device=self._param_device)
            self._part_views = [self.part] * len(self._qrest)
            return
        if self._materialized > 0 or not self.swapped:
            return
        views, kept = self._part_views, self._kept
        for b, view in enumerate(views):
            if b in self.swapped:
                assert self.param_swap is not None
                self.param_swap.store((self.index, b), view)
            else:
                kept[b].copy_(view)
        self._part_views, self.part = kept, torch.empty(0, dtype=self.compute_dtype, device=self._param_device)

    def gathered_bytes(self) -> int:
        """Memory the partitioned buckets gathered now hold beside the partition (in-place ones hold none)."""
        return self._full_bytes(skip=self.in_place | self.persistent)

    def _full_bytes(self, skip: set[int]) -> int:
        """Bytes behind the bucket-sized tensors, but those of ``skip`` (in-place ones share the partition's)."""
        return sum(t.untyped_storage().nbytes() for b, t in enumerate(self.full) if b not in skip)

    def live_numel(self) -> int:
        """Elements of the partitioned (not persistent) buckets gathered now (kept by gather / free)."""
        return self._live_numel

    # ------------------------------------------------------------------ GroupStorage interface
    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        if self.master_flat is None or self.frozen:
            return  # the masters are the partition buffer itself
        if self.master_swap is not None and not self.master_swap.resident:
            return  # NVMe: the tile-by-tile step wrote each bucket's parameters (ZeroStage._apply_step_tiled)
        for b, master in enumerate(self.masters):
            self.write_part(b, master.detach())

    @torch.no_grad()
    def copy_master_to_param(self, bucket: int) -> None:
        if self.master_flat is not None and not self.frozen:
            self.write_part(bucket, self.masters[bucket].detach())

    def sixteen_bit_output(self, bucket: int) -> torch.Tensor | None:
        if self.master_flat is None or self.frozen or self.compute_dtype not in (torch.bfloat16, torch.float16):
            return None
        if self._param_device != self.master_flat.device:
            return None
        if bucket in self.swapped and not self._materialized:  # written to the swap file after the step
            return torch.empty(self._shard_numels()[bucket], dtype=self.compute_dtype, device=self._param_device)
        return self._part_views[bucket]

    def store_sixteen_bit_output(self, bucket: int, out: torch.Tensor) -> None:
        if out is not self._part_views[bucket]:
            self.write_part(bucket, out)

    def sixteen_bit_outputs(self) -> dict[torch.Tensor, torch.Tensor]:
        """master -> this rank's 16-bit partition piece (see ``GroupStorage.sixteen_bit_outputs``)."""
        if self.master_flat is None or self.frozen or self.part.dtype not in (torch.bfloat16, torch.float16):
            return {}
        if self.part.device != self.master_flat.device:
            return {}
        return dict(zip(self.masters, self._part_views, strict=True))

    def numel_bytes(self) -> dict[str, int]:
        live = self._full_bytes(skip=self.in_place)
        live += sum(t.numel() * t.element_size() for t in self.secondary.values())
        if self._qrest is not None and not self._materialized:
            live += sum(qt.nbytes for qt in self._qrest)
        master = 0 if self.master_flat is None else self.master_flat.numel() * self.master_flat.element_size()
        part = self.part.numel() if not self.swapped or self._materialized else sum(v.numel() for v in self._part_views)
        return {"params": part * self.part.element_size() + live, "master": master}


def _compute_device(params: Sequence[nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


class _LazyBuffer:
    """A scratch buffer allocated on first use, at the largest size asked for so far."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.tensor = torch.empty(0, dtype=dtype, device=device)

    def get(self, numel: int) -> torch.Tensor:
        if self.tensor.numel() < numel:
            self.tensor = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.tensor[:numel]
