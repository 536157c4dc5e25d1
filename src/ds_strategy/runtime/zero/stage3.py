"""Stage 3: parameters partitioned at rest, gathered around each module's forward and backward.

Gradients, masters and optimizer state are exactly stage 2's (this class extends ``Stage2``): every
bucket is reduce-scattered to its owners while backward runs and each rank steps its shards. What stage
3 adds is the compute-dtype parameters themselves living as shards (``ShardedGroup``, see [Note: storage
swap]) and the module hooks that gather them when needed (``ParamGatherer``, see [Note: gather units and
hooks]). After a step only this rank's shards are updated in place: nothing is all-gathered until a
module next needs its parameters.

[Note: module-aligned buckets]
The layout is stage 2's, with two changes to the parameter order and the bucket boundaries: buckets
close where the owning module changes (the first module, in ``named_modules`` order, holding the
parameter directly; for a parameter inside a leaf module's subtree, the leaf, whose unit it is: see
[Note: leaf modules] in leaf.py), so gathering a module never drags in a neighbour's weights; and
parameters below ``stage3_param_persistence_threshold`` elements move to the end of their group, into
buckets of their own that stay gathered (persistent).

[Note: frozen parameters]
Parameters with ``requires_grad=False`` (a LoRA run's whole base model) are partitioned exactly like
trainable ones, into one more ``ShardedGroup`` (``self.frozen``, after the trainable groups in
``self.storages``) built with ``frozen=True``: the same module-aligned buckets, persistence threshold,
gathers, prefetch and ``zero.Init`` hand-over, but no fp32 masters, no gradient hooks, no reduction and
no optimizer state; they are never published (nothing changes them but ``GatheredParameters`` with a
modifier rank, which writes the partition back). How their buckets are freed in backward, where no
gradient tells us a module is done: [Note: frozen buckets in backward] in module_hooks.py. A parameter
that requires grad but is left out of the optimizer stays whole (autograd gives it a full gradient).
Another library's 4-bit packed parameters (QLoRA's base) go in one more storage after those, ``self.packed``,
partitioned as raw bytes with their quantization state ([Note: packed partitions] in packed_store.py).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import host_memory
from ..host_memory import trim_heap
from ..layout import BucketKey
from ..packed import is_packed, state_tensors
from .base import StageOptions, ZeroStage
from .buffers import GroupStorage
from .collectives import Collectives, Handle
from .init import init_shard, mark_full_shape, unpartition_param
from .offload import HOST, Offload
from .packed_store import PackedGroup
from .param_gather import ParamGatherer
from .placement import ZERO3_ATTR, PartitionedParameters
from .sharded import ShardedGroup
from .stage2 import Stage2
from .units import MODULES, check_policy, policy_of, unit_owners
from .zeropp import ZeroPP

log = logging.getLogger("ds_strategy.runtime")


@dataclass(frozen=True)
class Stage3Options:
    """The ``stage3_*`` and ``offload_param`` keys this stage reads (DeepSpeed's names and meaning)."""

    persistence_threshold: int = 100_000
    model_persistence_numel: int = sys.maxsize  # stage3_model_persistence_threshold: see ``_persistent``
    prefetch_numel: int | None = 50_000_000  # None: the key was not given (the next unit, see param_gather.py)
    max_live_numel: int = 1_000_000_000
    reuse_distance: int | None = 1_000_000_000  # None: not given ([Note: reshard after use], prefetch.py)
    param_device: torch.device | None = None  # offload_param: where the shards live (None: compute device)
    param_pin: bool = False  # offload_param.pin_memory: page-locked host shards (used with a CUDA device)
    gather_on_save: bool = False
    # ZeRO++ (DeepSpeed's key names; see [Note: ZeRO++] in zeropp.py)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_gradients: bool = False
    fetch_units: Any = None  # stage3_fetch_units (see [Note: fetch units] in units.py); None: "blocks"
    tile_frozen: bool = True  # stage3_tile_frozen ([Note: tiled frozen weights] in tiled.py)

    @classmethod
    def from_config(cls, config: Any, offload: Offload) -> Stage3Options:
        zero = config.zero_optimization
        return cls(
            persistence_threshold=int(zero.stage3_param_persistence_threshold),
            model_persistence_numel=int(zero.stage3_model_persistence_threshold),
            prefetch_numel=(
                int(zero.stage3_prefetch_bucket_size) if _given(config, "stage3_prefetch_bucket_size") else None
            ),
            max_live_numel=int(zero.stage3_max_live_parameters),
            reuse_distance=int(zero.stage3_max_reuse_distance) if _given(config, "stage3_max_reuse_distance") else None,
            param_device=HOST if offload.params else None,
            param_pin=offload.params and offload.pin_params,
            gather_on_save=bool(zero.stage3_gather_16bit_weights_on_model_save),
            zero_quantized_weights=bool(zero.zero_quantized_weights),
            zero_quantized_nontrainable_weights=bool(zero.zero_quantized_nontrainable_weights),
            zero_hpz_partition_size=int(zero.zero_hpz_partition_size),
            zero_quantized_gradients=bool(zero.zero_quantized_gradients),
            fetch_units=_config_policy(zero.stage3_fetch_units),
            tile_frozen=bool(zero.stage3_tile_frozen),
        )


class Stage3(Stage2):
    stage = 3
    partitioned = True
    reduces_every_backward = True
    places_its_parameters = True  # bucket by bucket while partitioning: the whole model never on the device
    bucket_keys = ("reduce_bucket_size",)  # gathers by unit, not by allgather_bucket_size (as DeepSpeed)

    @classmethod
    def create(
        cls,
        groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
        registration: dict[nn.Parameter, int],
        *,
        coll: Collectives,
        options: StageOptions,
        module: nn.Module,
        config: Any,
    ) -> ZeroStage:
        return cls(
            groups,
            registration,
            coll=coll,
            options=options,
            module=module,
            s3=Stage3Options.from_config(config, options.offload),
        )

    def __init__(
        self,
        groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
        registration: dict[nn.Parameter, int],
        *,
        coll: Collectives,
        options: StageOptions,
        module: nn.Module,
        s3: Stage3Options,
    ) -> None:
        self.module = module
        self.s3 = s3
        devices = {p.device for named in groups for _, p in named}
        self._host_compute = any(d.type == "cpu" for d in devices)
        if any(d.type == "cpu" and not host_memory.pooled(d) for d in devices):
            host_memory.return_freed_memory_to_os()  # see [Note: gathered buckets and host memory]
        owner: dict[int, int] = {}
        position = {id(m): n for n, m in enumerate(module.modules())}
        # Each parameter belongs to its fetch unit ([Note: fetch units] in units.py; a leaf's subtree is the
        # leaf's: [Note: leaf modules]); under block units a unit is one bucket, whatever its size.
        self.fetch_policy = policy_of(module, s3.fetch_units)
        owners = unit_owners(module, self.fetch_policy, _numel)
        self.block_units = self.fetch_policy != MODULES and any(
            owners[id(m)] is not m for m in module.modules() if m._parameters
        )
        for m in module.modules():
            for p in m._parameters.values():
                if p is not None:
                    owner.setdefault(id(p), position[id(owners[id(m)])])
        trainable = {id(p) for named in groups for _, p in named}
        frozen, packed = _frozen(module, trainable)
        persistent = _persistent(module, trainable | {id(p) for _, p in frozen + packed}, s3)
        self._plans: list[tuple[set[int], set[int]]] = []
        self.zeropp = ZeroPP.from_config(s3, coll)  # before the groups: they gather through it
        ordered = [self._plan(named, owner, persistent) for named in groups]
        frozen_plan = self._plan(frozen, owner, persistent)
        packed_plan = self._plan(packed, owner, persistent)
        super().__init__(ordered, registration, coll=coll, options=options)
        self.sharded: list[ShardedGroup] = [gs for gs in self.groups if isinstance(gs, ShardedGroup)]
        # [Note: frozen parameters] are partitioned like trainable ones, in a storage of their own after the
        # trainable groups: gathered around forward and backward, never reduced, no masters.
        self.frozen: list[ShardedGroup] = (
            [self._make_group(len(ordered), frozen_plan, frozen=True)] if frozen_plan else []
        )
        # 4-bit packed parameters: their bytes, codes and quantization state ([Note: packed partitions]).
        self.packed: list[ShardedGroup] = [self._make_packed(len(ordered) + 1, packed_plan)] if packed_plan else []
        self.storages: list[ShardedGroup] = self.sharded + self.frozen + self.packed  # what gather keys index
        self.swapped = list(self.storages)
        # NVMe optimizer offload: the gradient partitions rest in the swap file too, one holder per master
        # (see [Note: swapped tensors] in runtime/swap/optimizer.py), written as each bucket's shard lands.
        self._grad_holders: list[list[torch.Tensor]] = []
        if self.swapper is not None:
            for gs in self.sharded:
                holders = [torch.empty(0) for _ in gs.masters]
                for master, holder in zip(gs.masters, holders, strict=True):
                    self.swapper.bind_grad(master, holder)
                self._grad_holders.append(holders)
        for g, gs in enumerate(self.storages):
            for i, p in enumerate(gs.params):
                setattr(p, ZERO3_ATTR, (self, g, i))
                mark_full_shape(p, gs.layout.params[i].shape)
        self.gatherer = ParamGatherer(
            self.storages,
            module,
            coll,
            prefetch_numel=s3.prefetch_numel,
            max_live_numel=s3.max_live_numel,
            reuse_distance=s3.reuse_distance,
            policy=self.fetch_policy,
            tile_frozen=s3.tile_frozen,
        )
        self.placement = PartitionedParameters(
            self,
            self.storages,
            trainable=len(self.sharded),
            bucket_order=self.bucket_order,
            gatherer=self.gatherer,
            coll=coll,
        )
        if self.swap is not None:
            trim_heap()  # the build's freed blocks ([Note: host memory under NVMe offload], runtime/swap)

    def _plan(
        self, named: Sequence[tuple[str, nn.Parameter]], owner: dict[int, int], persistent: set[int]
    ) -> list[tuple[str, nn.Parameter]]:
        """``named`` in layout order (persistent parameters last) with its bucket plan appended to ``_plans``
        (see [Note: module-aligned buckets])."""
        big = [(n, p) for n, p in named if id(p) not in persistent]
        small = [(n, p) for n, p in named if id(p) in persistent]
        if self.block_units:  # one bucket per unit: its parameters side by side (the rest's are spread out)
            first: dict[int, int] = {}
            for _, p in big:
                first.setdefault(owner[id(p)], len(first))
            big.sort(key=lambda item: first[owner[id(item[1])]])
        items = big + small
        # Persistent parameters are never gathered: under block units they share buckets across units, so a
        # model's small parameters (norms, biases) cost one reduce-scatter, not one per block.
        last = len(items) if not self.block_units else len(big)
        breaks = {
            i
            for i in range(1, len(items))
            if i == len(big) or (i < last and owner[id(items[i][1])] != owner[id(items[i - 1][1])])
        }
        self._plans.append((breaks, set(range(len(big), len(items)))))
        return items

    def memory_bytes(self) -> dict[str, int]:
        """``gathered_params``: the partitioned buckets gathered now (by hooks, GatheredParameters or the hybrid
        engine's hold); ``params`` the rest (partitions, persistent buckets)."""
        out = super().memory_bytes()
        out["params"] += sum(gs.numel_bytes()["params"] for gs in self.frozen + self.packed)
        gathered = sum(gs.gathered_bytes() for gs in self.storages)
        out["params"] -= gathered
        out["gathered_params"] = gathered
        return out

    def _make_group(
        self, index: int, named: Sequence[tuple[str, nn.Parameter]], *, frozen: bool = False
    ) -> ShardedGroup:
        breaks, persistent = self._plans[index]
        device = self.options.device or next((p.device for _, p in named), torch.device("cpu"))
        return ShardedGroup(
            index,
            named,
            coll=self.coll,
            # Block units are never split by reduce_bucket_size: one unit, one all-gather, one reduce-scatter.
            bucket_numel=sys.maxsize if self.block_units else self.options.bucket_numel,
            breaks=breaks,
            persistent=persistent,
            compute_dtype=self.options.compute_dtype,
            master_device=self.options.master_device or device,
            param_device=self.s3.param_device or device,
            device=device,
            pin_memory=self.options.pin_memory,
            pin_part=self.s3.param_pin and device.type == "cuda",
            frozen=frozen,
            param_swap=self.swap.params if self.swap is not None else None,
            master_swap=self.swapper,
            keep_in_cpu=nvme.max_in_cpu if (nvme := self.options.offload.params_nvme) is not None else 0,
            zeropp=self.zeropp,
            whole_params=self.options.whole(index) and not frozen,
        )

    def _make_packed(self, index: int, named: Sequence[tuple[str, nn.Parameter]]) -> PackedGroup:
        breaks, persistent = self._plans[index]
        device = self.options.device or named[0][1].device
        return PackedGroup(
            index,
            named,
            root=self.module,
            coll=self.coll,
            bucket_numel=sys.maxsize if self.block_units else self.options.bucket_numel,
            breaks=breaks,
            persistent=persistent,
            param_device=self.s3.param_device or device,
            device=device,
        )

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        super().attach()
        self.gatherer.attach()

    def detach(self) -> None:
        super().detach()
        self.gatherer.detach()
        host_memory.trim()

    def bucket_complete(self, key: BucketKey) -> None:
        self.gatherer.grads_done(key)  # see [Note: gather units and hooks]

    def _partition_grad(self, gs: GroupStorage) -> torch.Tensor:
        """Released (0 elements) until a reduction lands in it: neither the engine build nor the time
        between a step and the next backward holds the gradient partition."""
        return torch.empty(0, dtype=torch.float32, device=gs.device)

    def launch_reduction(self, key: BucketKey) -> Handle:
        gs = self.groups[key[0]]
        if self.swapper is None and self.partition_grads[key[0]].numel() != gs.layout.partition_numel:
            # Every bucket is launched in every reducing pass and its first landing overwrites, so the
            # fresh partition needs no zeroing.
            self.partition_grads[key[0]] = torch.empty(gs.layout.partition_numel, dtype=torch.float32, device=gs.device)
        return super().launch_reduction(key)

    def _reduces_in_place(self, group: int) -> bool:
        quantized = self.zeropp is not None and self.zeropp.quantized_grads  # qgZ quantizes its input first
        return super()._reduces_in_place(group) and not quantized

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, group: int = 0, async_op: bool = False
    ) -> Handle:
        if self.zeropp is not None and self.zeropp.quantized_grads:  # qgZ: see [Note: ZeRO++] in zeropp.py
            return self.zeropp.reduce_scatter(output, input, async_op=async_op)
        return super()._reduce_scatter(output, input, group=group, async_op=async_op)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Also: int8 frozen partitions (zero_quantized_nontrainable_weights) dequantized into a compute-dtype
        ``part`` for the block (checkpoints, full-state access), re-quantized at its end if written."""
        quantized = [gs for gs in self.frozen if gs.quantized_rest]
        if self.swap is not None or not quantized:  # with NVMe the base materializes every storage
            with super().resident():
                yield
            return
        for gs in quantized:
            gs.materialize()
        try:
            yield
        finally:
            for gs in quantized:
                gs.dematerialize()

    def close(self) -> None:
        """Also close ZeRO++'s node-group communicators (the engine's destroy)."""
        super().close()
        if self.zeropp is not None:
            self.zeropp.close()

    def _partition_out(self, key: BucketKey, fresh: bool) -> torch.Tensor:
        if self.swapper is None:
            return super()._partition_out(key, fresh)
        g, b = key
        master = self.groups[g].masters[b]
        out = torch.empty(self.swapper.numel[master], dtype=torch.float32, device=self.groups[g].device)
        if not fresh:
            self.swapper.get_grad(master, out)  # this window's earlier backwards (gradient accumulation)
        return out

    def _landed(self, key: BucketKey, out: torch.Tensor) -> None:
        if self.swapper is not None:
            self.swapper.put_grad(self.groups[key[0]].masters[key[1]], out)
            if self._host_compute:
                trim_heap()  # [Note: host memory under NVMe offload] in runtime/swap/__init__.py

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]:
        if self.swapper is not None:
            return self._grad_holders[group]  # placeholders outside a swap-in
        return super().reduced_grads_of(group)

    def _reset_window(self) -> None:
        """After a step: also release the partition gradients until the next backward lands one."""
        super()._reset_window()
        self.partition_grads = [self._partition_grad(gs) for gs in self.groups]

    def begin_backward(self, *, reduce: bool) -> None:
        super().begin_backward(reduce=reduce)
        if self._host_compute:  # see [Note: the loss's peak] in host_memory.py
            if not self.gatherer.gave_back:
                host_memory.give_back_idle()
            self.gatherer.gave_back = False
            host_memory.trim_heap_at_next_allocation()

    def end_backward(self, *, failed: bool = False) -> None:
        super().end_backward(failed=failed)
        self.gatherer.end_backward(failed=failed)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def publish(self, params_written: Collection[int] = ()) -> None:
        """Masters -> this rank's compute-dtype shards (unless the optimizer pass wrote them: see
        [Note: the fused optimizer pass]); refresh the buckets that stay gathered."""
        for g, gs in enumerate(self.groups):
            if g not in params_written:
                gs.copy_masters_to_params()
        for gs in self.sharded:
            gs.drop_secondaries()  # hpZ: the next gathers read the updated primary partitions
        handles = []
        for g, b in self.bucket_order:
            gs = self.sharded[g]
            if gs.live[b]:
                mine = gs.full[b].view(self.coll.world_size, -1)[self.coll.rank]
                gs.read_part(b, mine)
                handles.append(self.coll.all_gather(gs.full[b], mine, async_op=self.options.async_comm))
        for h in handles:
            h.wait()
        if self.swap is not None and self.swap.params is not None:
            self.swap.params.end_step()  # see [Note: parameter read-ahead]

    # ------------------------------------------------------------------ full access


def _given(config: Any, key: str) -> bool:
    """Whether the user's config states ``zero_optimization.<key>`` (rather than taking the default)."""
    given = getattr(config, "input_config", None)
    if given is None:
        return True  # built in code, not from a dict: every value counts as stated
    return key in (given.get("zero_optimization") or {})


def _config_policy(value: Any) -> Any:
    """``stage3_fetch_units`` as a policy: ``"blocks"``, ``"modules"`` or a tuple of class names."""
    policy = value if isinstance(value, str) or value is None else tuple(value)
    check_policy(policy, "zero_optimization.stage3_fetch_units")
    return policy


def _frozen(
    module: nn.Module, trainable: set[int]
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """The parameters stage 3 partitions without training them (see [Note: frozen parameters]): floating
    ones with ``requires_grad=False``, and apart from them the 4-bit packed ones it partitions as bytes
    ([Note: packed partitions] in packed_store.py); each once (tied parameters under their first name). A
    parameter that requires grad but is left out of the optimizer stays whole: autograd still gives it a
    full gradient; so do int8 packed ones ([Note: packed parameters])."""
    out: list[tuple[str, nn.Parameter]] = []
    packed: list[tuple[str, nn.Parameter]] = []
    for name, p in module.named_parameters():
        if id(p) in trainable:
            continue
        if is_packed(p) and not p.requires_grad and state_tensors(p) is not None:
            packed.append((name, p))
        elif p.requires_grad or not p.is_floating_point() or is_packed(p):
            unpartition_param(p)
        else:
            out.append((name, p))
    return out, packed


def _numel(p: torch.Tensor) -> int:
    info = init_shard(p)
    return info.numel if info is not None else p.numel()


def _persistent(module: nn.Module, partitioned: set[int], s3: Stage3Options) -> set[int]:
    """ids of the partitioned parameters (trainable or frozen) that stay gathered: below
    ``stage3_param_persistence_threshold`` elements, taken in ``named_parameters`` order while their total
    stays within ``stage3_model_persistence_threshold`` (DeepSpeed's ``mark_persistent_parameters``)."""
    chosen: set[int] = set()
    total = 0
    for _, p in module.named_parameters():
        if id(p) not in partitioned or id(p) in chosen:
            continue
        n = _numel(p)
        if n < s3.persistence_threshold and total + n <= s3.model_persistence_numel:
            chosen.add(id(p))
            total += n
    return chosen
