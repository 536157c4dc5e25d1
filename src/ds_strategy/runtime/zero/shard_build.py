"""Stage 3's build of one param group: every rank agrees on the values and keeps only its shards.

``ShardBuild`` fills a ``ShardedGroup``'s partition (its ``PartitionRest``) and fp32 masters from the
module's parameters, one bucket at a time, and returns what the group keeps beside them: the masters and
one bucket-sized tensor per bucket (whole for persistent buckets, storage-less for the others).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import host_memory
from ..layout import FlatLayout
from ..swap import OptimizerSwapper
from .collectives import Collectives
from .init import gather_init_param, init_shard, release_init_shard
from .partition_rest import PartitionRest

BUILD_CHUNK = 1 << 22  # elements: the most of a bucket the build holds in fp32 scratch at once (16 MiB)


@dataclass
class Shards:
    """What the build leaves a ``ShardedGroup`` beside its partition."""

    aliased: bool  # the masters are the fp32 partition itself
    master_flat: torch.Tensor | None
    masters: list[nn.Parameter]  # one fp32 leaf per bucket; none when frozen
    full: list[torch.Tensor]  # per bucket: whole (persistent) or without storage (filled by gather)
    live: list[bool]  # per bucket: persistent ones are live for good


class ShardBuild:
    """The build of one ``ShardedGroup``: the masters it allocates, the scratch buffers it shares between
    buckets and the taking of each bucket (``run``)."""

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        layout: FlatLayout,
        rest: PartitionRest,
        *,
        coll: Collectives,
        persistent: Collection[int],
        compute_dtype: torch.dtype,
        device: torch.device,
        placeholder: torch.Tensor,
        master_swap: OptimizerSwapper | None,
    ) -> None:
        """Partition ``params`` (laid out by ``layout``) into ``rest`` and fresh masters (``master_swap``:
        into its swap file); each parameter's ``.data`` becomes ``placeholder`` as its bucket is taken (the
        group points the persistent ones into their bucket afterwards)."""
        self.index, self.params, self.layout, self.rest, self.coll = index, params, layout, rest, coll
        self.persistent, self.compute_dtype, self.device = persistent, compute_dtype, device
        self.placeholder, self.master_swap = placeholder, master_swap

    def run(self, *, master_device: torch.device, pin_memory: bool, frozen: bool) -> Shards:
        """Allocate the masters on ``master_device``, take every bucket and return what the group keeps."""
        rest, layout, master_swap = self.rest, self.layout, self.master_swap
        swapping = rest.swap is not None or master_swap is not None
        aliased = self.compute_dtype == torch.float32 and master_device == rest.device and not swapping
        master_flat: torch.Tensor | None
        if aliased or frozen:
            master_flat = None
        elif master_swap is not None:
            master_flat = torch.empty(0, dtype=torch.float32, device=master_device)
        else:
            numel = layout.partition_numel
            master_flat = torch.empty(numel, dtype=torch.float32, device=master_device, pin_memory=pin_memory)
        if master_flat is None:
            master_views = rest.views
        elif master_swap is not None:
            master_views = []  # written straight to the swap file by _take_bucket
        else:
            master_views = layout.partition_views(master_flat)
        full, live = self._take_buckets(master_views)
        # One leaf per bucket for the optimizer (see [Note: master weights] in buffers.py); none when frozen.
        if frozen:
            masters: list[nn.Parameter] = []
        elif master_swap is not None:  # NVMe: the masters rest in the swap file (written by _take_bucket)
            masters = [nn.Parameter(torch.empty(0, device=master_device)) for _ in layout.buckets]
            for b, (master, n) in enumerate(zip(masters, rest.numels, strict=True)):
                master_swap.bind(master, (self.index, b), n)
        else:
            masters = [nn.Parameter(piece) for piece in master_views]
        return Shards(aliased and not frozen, master_flat, masters, full, live)

    def _take_buckets(self, master_views: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
        """Take every bucket; return the bucket-sized tensors and which are live (the persistent ones)."""
        # Built one bucket at a time: beyond this rank's partition, only one full-size bucket (in fp32,
        # plus its compute-dtype twin when persistent) exists at once, and each parameter's original
        # storage is dropped as soon as its bucket is partitioned.
        # Three scratch buffers serve every bucket (a chunk of the bucket in fp32, this rank's fp32 shard where
        # it cannot be assembled in place, one gathered zero.Init parameter): per-bucket temporaries of
        # alternating lifetimes would fragment the host heap, which then keeps about the whole model resident
        # (measured with MALLOC_PERTURB_: 2.5x the model instead of 0.6x). The chunk bounds the build's
        # scratch whatever the bucket: a block unit's bucket (the rest of a model: embeddings and head) can be
        # a large part of the model, which every rank still holds whole while it is being partitioned.
        longest = max((b.padded for b in self.layout.buckets), default=0)
        scratch32 = torch.empty(min(longest, BUILD_CHUNK), dtype=torch.float32, device=self.device)
        shard32 = _LazyBuffer(torch.float32, self.device)
        world = self.coll.world_size
        gathered = max((s.per * world for s in map(init_shard, self.params) if s is not None), default=0)
        gather_buf = torch.empty(gathered, dtype=torch.float32, device=self.device) if gathered else None
        freed = 0  # bytes of original parameter storage dropped since the last heap trim
        buckets = self.layout.buckets
        full = [self.placeholder] * len(buckets)
        live = [False] * len(buckets)
        # Smallest first: a bucket's parameters stay whole until their last chunk is copied while its partition
        # fills, so the largest (an embedding or a head, several times a block) is taken last, once the others'
        # storage is gone (the 162M Llama of bench_lora_lightning: setup peak +62 MiB over stage 2 in layout
        # order). The order is the layout's, so every rank broadcasts the same chunks in the same order.
        for b in sorted(range(len(buckets)), key=lambda b: buckets[b].padded):
            whole, dropped = self._take_bucket(b, scratch32, shard32, gather_buf, master_views)
            # a persistent bucket's parameters are pointed into it by the group; the others' tensor is given
            # its own (storage-less) tensor once the scratch buffers are gone
            if whole is not None:
                full[b], live[b] = whole, True
            freed += dropped
            if self.device.type == "cpu" and freed >= BUILD_CHUNK * 4:
                # glibc keeps freed mid-sized blocks in its heap, so without a trim the build's peak is the
                # whole model plus every partition taken so far; a trim costs milliseconds, so once a chunk's
                # worth of parameters is gone, not after every (possibly tiny) bucket.
                host_memory.trim_heap()
                freed = 0
        del scratch32, shard32, gather_buf
        for b, bucket in enumerate(self.layout.buckets):
            if b not in self.persistent:  # a bucket-sized tensor without storage, filled by gather()
                full[b] = host_memory.unallocated(bucket.padded, self.compute_dtype, self.device)
        return full, live

    @torch.no_grad()
    def _take_bucket(
        self,
        b: int,
        scratch32: torch.Tensor,
        shard32: _LazyBuffer,
        gather_buf: torch.Tensor | None,
        master_views: list[torch.Tensor],
    ) -> tuple[torch.Tensor | None, int]:
        """Build bucket ``b`` in fp32 (exact for every input dtype), one chunk of ``scratch32`` at a time, and
        keep this rank's shard of it. Rank 0's values win, as in stages 0-2; parameters built under zero.Init
        are already agreed: gathered, not broadcast, and their zero.Init shards dropped once taken. Returns
        the whole bucket in the compute dtype when it is persistent (else None) and the bytes of parameter
        storage it dropped."""
        bucket = self.layout.buckets[b]
        per = bucket.padded // self.coll.world_size
        lo, hi = self.coll.rank * per, (self.coll.rank + 1) * per  # this rank's shard, in bucket coordinates
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
                    p.data = self.placeholder
                    source = None
            if not from_init:
                self.coll.broadcast(chunk)
            a, z = max(c0, lo), min(c1, hi)
            if a < z:
                mine[a - lo : z - lo].copy_(chunk[a - c0 : z - c0])
            if whole is not None:
                whole[c0:c1].copy_(chunk)
        views = self.rest.views
        if mine is not views[b]:
            self.rest.write(b, mine)
        if self.master_swap is not None:
            self.master_swap.store((self.index, b), mine)
        elif master_views is not views and mine is not master_views[b]:
            master_views[b].copy_(mine)
        return whole, dropped

    def _shard_target(self, b: int, per: int, shard32: _LazyBuffer, master_views: list[torch.Tensor]) -> torch.Tensor:
        """Where bucket ``b``'s fp32 shard is assembled: in place (the fp32 master, or an fp32 partition the
        plain way), else in the shared scratch shard."""
        if self.master_swap is None and master_views is not self.rest.views:
            return master_views[b]
        view = self.rest.views[b]
        if view.dtype == torch.float32 and view.numel() == per and b not in self.rest.swapped:
            return view
        return shard32.get(per)


class _LazyBuffer:
    """A scratch buffer allocated on first use, at the largest size asked for so far."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.tensor = torch.empty(0, dtype=dtype, device=device)

    def get(self, numel: int) -> torch.Tensor:
        if self.tensor.numel() < numel:
            self.tensor = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.tensor[:numel]
