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
from typing import Any

import torch
from torch import nn

from .. import host_memory
from ..layout import FlatLayout
from ..swap import OptimizerSwapper, PartitionSwapper
from .buffers import GroupStorage
from .collectives import DONE, Collectives, Handle
from .init import init_shard
from .partition_rest import PartitionRest
from .shard_build import ShardBuild, Shards
from .streams import GatherStream
from .zeropp import ZeroPP

LayoutEntry = tuple[str, tuple[int, ...] | torch.Size, torch.dtype]


class ShardedGroup(GroupStorage):
    """Partition buffer, per-bucket gathered tensors and fp32 masters of one param group (stage 3).

    The ``GroupStorage`` the stage machinery and checkpoints use (``layout``, ``params``, ``masters``,
    ``master_shaped``, ``copy_masters_to_params``, ``numel_bytes``); nothing full-size is kept. The
    partition, wherever it rests, is its ``rest`` (partition_rest.py); the build is shard_build.py's.
    """

    # [Note: a group of one gathers in place]; tests measuring world size 1 as a rank of a larger group
    # gathers (a memory baseline with the same working set) set it False.
    GATHER_IN_PLACE: bool = True
    # When the engine lets go of the model, the parameters stay zero.Init shards (False) or go back whole
    # (``hand_back``: packed_store.py's bytes).
    hands_back_whole: bool = False

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
        whole_params: bool = False,
    ) -> None:
        self.index = index
        self.frozen = frozen  # parameters nobody trains: no masters, gradients or optimizer state
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.partitioned = True
        self.rank = coll.rank
        self.coll = coll
        self.layout = FlatLayout.build(
            self._layout_entries(named_params),
            world_size=coll.world_size,
            bucket_numel=bucket_numel,
            breaks=breaks,
            whole_params=whole_params,
        )
        # The compute device: where gathered buckets live. A CPU-built module's trainable parameters are
        # not moved there whole by the engine: each bucket goes over in turn (shard_build.py).
        self.device = device or _compute_device(self.params)
        self.compute_dtype = compute_dtype
        self.persistent = {b.index for b in self.layout.buckets if all(i in persistent for i in b.params)}
        self.master_swap = None if frozen else master_swap
        # offload_param.pin_memory pins the host partition (parameter-only offload too); pin_memory is the
        # optimizer offload's, for the fp32 masters.
        pin = pin_part and param_device.type == "cpu" and torch.cuda.is_available()
        self.rest = self._make_rest(
            index,
            self.layout,
            coll=coll,
            persistent=self.persistent,
            compute_dtype=compute_dtype,
            device=param_device,
            pin=pin,
            swap=param_swap,
            keep_in_cpu=keep_in_cpu,
            zeropp=zeropp,
            frozen=frozen,
        )
        self._param_views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # see _point_params
        self._live_numel = 0
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=self.device)
        shards = self._build(master_device=master_device, pin_memory=pin_memory)
        self.aliased, self.master_flat, self.masters = shards.aliased, shards.master_flat, shards.masters
        self.full, self.live = shards.full, shards.live
        for b in sorted(self.persistent):  # whole for good: their parameters point into them from now on
            self._point_params(b)
        # ZeRO++ ([Note: ZeRO++] in zeropp.py): quantized gathers, int8 frozen partitions, hpZ secondaries.
        if zeropp is not None and frozen and zeropp.quantized_frozen:
            self.rest.rest_int8()
        self.quantized_rest = self.rest.quantized  # the partitions rest as int8 (decided here, for good)
        self.in_place = self._gather_in_place(coll.world_size)

    def _make_rest(self, *args: Any, **kwargs: Any) -> PartitionRest:
        """The partition's resting place (``PartitionRest``), made before ``_build`` fills it."""
        return PartitionRest(*args, **kwargs)

    def _layout_entries(self, named_params: Sequence[tuple[str, nn.Parameter]]) -> list[LayoutEntry]:
        """``(name, shape, dtype)`` of each parameter in the flat layout (a ``zero.Init`` shard's whole shape)."""
        return [(n, p.shape if (info := init_shard(p)) is None else info.shape, p.dtype) for n, p in named_params]

    def _build(self, *, master_device: torch.device, pin_memory: bool) -> Shards:
        """Take the parameters into the partition (and masters), bucket by bucket (shard_build.py)."""
        build = ShardBuild(
            self.index,
            self.params,
            self.layout,
            self.rest,
            coll=self.coll,
            persistent=self.persistent,
            compute_dtype=self.compute_dtype,
            device=self.device,
            placeholder=self._placeholder,
            master_swap=self.master_swap,
        )
        return build.run(master_device=master_device, pin_memory=pin_memory, frozen=self.frozen)

    def _gather_in_place(self, world_size: int) -> set[int]:
        """[Note: a group of one gathers in place] With one rank, a bucket's partition is the whole bucket:
        its gather would copy the partition into a bucket-sized tensor of the same values. So where the
        partition rests on the compute device in the compute dtype (no parameter offload, no swap file, no
        int8 rest), the bucket's gathered tensor *is* the partition: a gather points the parameters into
        it and counts it live, a free points them away; nothing is allocated or copied, and the hooks,
        prefetch and live limits run as at any world size. A step's update of the partition is what the
        parameters read next."""
        rest = self.rest
        resting_elsewhere = rest.quantized or rest.swapped or rest.device != self.device
        if not self.GATHER_IN_PLACE or world_size != 1 or rest.hpz is not None or resting_elsewhere:
            return set()
        chosen = set()
        for b, bucket in enumerate(self.layout.buckets):
            view = rest.views[b]
            if b not in self.persistent and view.numel() == bucket.padded and view.dtype == self.compute_dtype:
                self.full[b] = view
                chosen.add(b)
        return chosen

    @property
    def part(self) -> torch.Tensor:
        """This rank's whole partition as one buffer (0 elements while it rests in the swap file or as int8:
        see ``PartitionRest``)."""
        return self.rest.part

    # ------------------------------------------------------------------ views
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

    def _point_away(self, bucket: int) -> None:
        """The bucket is being freed: its parameters become 0-element placeholders (see [Note: storage swap])."""
        for i in self.layout.buckets[bucket].params:
            self.params[i].data = self._placeholder

    def bucket_tensors(self, bucket: int) -> list[torch.Tensor]:
        """The tensors whose values the gathered ``bucket`` holds (full state dicts copy them): its parameters."""
        return [self.params[i] for i in self.layout.buckets[bucket].params]

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
        rest = self.rest
        if stream is None or rest.needs_compute_stream(bucket, exact):
            return rest.gather_into(full, bucket, async_op=async_op, tag=tag, exact=exact)
        with stream.issue():
            return stream.ordered(rest.gather_into(full, bucket, async_op=async_op, tag=tag, exact=exact))

    def drop_secondaries(self) -> None:
        """The parameters changed (a step, an edit, a load): the next gather goes to the primary partitions."""
        self.rest.drop_secondaries()

    def free(self, bucket: int) -> None:
        """Drop the bucket's gathered storage (persistent buckets stay)."""
        if bucket in self.persistent or not self.live[bucket]:
            return
        self._point_away(bucket)
        if bucket not in self.in_place:  # an in-place bucket's storage is the partition: it stays
            host_memory.release(self.full[bucket])
        self.live[bucket] = False
        self._live_numel -= self.full[bucket].numel()

    def write_back(self, bucket: int) -> None:
        """After an edit of the gathered (live) bucket on every rank: keep this rank's shard of it as the new
        compute-dtype partition and fp32 master (used by GatheredParameters)."""
        mine = self.full[bucket].view(self.coll.world_size, -1)[self.rank]
        self.rest.write(bucket, mine)
        if self.master_swap is not None and not self.master_swap.resident:
            self.master_swap.store((self.index, bucket), mine)
        elif self.master_flat is not None:
            self.masters[bucket].data.copy_(mine)

    def read_part(self, bucket: int, out: torch.Tensor, *, trace: bool = False) -> None:
        """Copy this rank's compute-dtype partition of ``bucket`` into ``out`` (``PartitionRest.read``)."""
        self.rest.read(bucket, out, trace=trace)

    def materialize(self) -> None:
        """The whole partition in host memory as one ``part`` buffer, as without NVMe (``resident``)."""
        self.rest.materialize()

    def dematerialize(self) -> None:
        self.rest.dematerialize()

    def gathered_bytes(self) -> int:
        """Memory the partitioned buckets gathered now hold beside the partition (in-place ones hold none)."""
        return _full_bytes(self.full, skip=self.in_place | self.persistent)

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
            self.rest.write(b, master.detach())

    @torch.no_grad()
    def copy_master_to_param(self, bucket: int) -> None:
        if self.master_flat is not None and not self.frozen:
            self.rest.write(bucket, self.masters[bucket].detach())

    def sixteen_bit_output(self, bucket: int) -> torch.Tensor | None:
        if self.master_flat is None or self.frozen or self.compute_dtype not in (torch.bfloat16, torch.float16):
            return None
        rest = self.rest
        if rest.device != self.master_flat.device:
            return None
        if rest.in_swap_file(bucket):  # written to the swap file after the step
            return torch.empty(rest.numels[bucket], dtype=self.compute_dtype, device=rest.device)
        return rest.views[bucket]

    def store_sixteen_bit_output(self, bucket: int, out: torch.Tensor) -> None:
        if out is not self.rest.views[bucket]:
            self.rest.write(bucket, out)

    def sixteen_bit_outputs(self) -> dict[torch.Tensor, torch.Tensor]:
        """master -> this rank's 16-bit partition piece (see ``GroupStorage.sixteen_bit_outputs``)."""
        part = self.rest.part
        if self.master_flat is None or self.frozen or part.dtype not in (torch.bfloat16, torch.float16):
            return {}
        if part.device != self.master_flat.device:
            return {}
        return dict(zip(self.masters, self.rest.views, strict=True))

    def numel_bytes(self) -> dict[str, int]:
        master = 0 if self.master_flat is None else self.master_flat.numel() * self.master_flat.element_size()
        return {"params": self.rest.nbytes() + _full_bytes(self.full, skip=self.in_place), "master": master}


def _full_bytes(full: Sequence[torch.Tensor], skip: set[int]) -> int:
    """Bytes behind the bucket-sized tensors, but those of ``skip`` (in-place ones share the partition's)."""
    return sum(t.untyped_storage().nbytes() for b, t in enumerate(full) if b not in skip)


def _compute_device(params: Sequence[nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")
