"""Where a stage's compute-dtype parameters live, and what the rest of the runtime asks of them.

Stages 0-2 leave every parameter whole on every rank (``WholeParameters``: the module's own tensors, or
views of a stage's flat buffer). Stage 3 keeps them as shards gathered around their use
(``PartitionedParameters``). The engine, the hybrid engine, ``GatheredParameters`` and checkpoints reach
the parameters through ``stage.placement``: the full state dict, a one-time gather that holds everything
(generation), a user's gather of a few parameters, the hand-over to a later engine, the error hint of a
forward. Gradients and the optimizer step are not its business (base.py, step.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from .. import host_memory
from ..layout import BucketKey
from .collectives import Collectives
from .init import keep_shard

ZERO3_ATTR = "_ds_zero3"  # on each partitioned parameter: (its Stage3, storage index, index in the storage)


class Gatherer(Protocol):
    """What the placement asks of stage 3's ``ParamGatherer`` (param_gather.py)."""

    @property
    def suspended(self) -> bool: ...

    def acquire(self, keys: Sequence[BucketKey], why: str) -> None: ...

    def release_keys(self, keys: Sequence[BucketKey]) -> None: ...

    def hold(self, keys: Sequence[BucketKey], *, in_flight: int) -> None: ...

    def unhold(self) -> None: ...

    def unhook_inside(self, regions: Sequence[nn.Module]) -> None: ...


class WholeParameters:
    """Every rank holds every parameter whole (stages 0-2): nothing to gather, hold or hand over."""

    def __init__(self, groups: Sequence[Any], coll: Collectives) -> None:  # GroupStorage (buffers.py)
        self._groups = groups
        self._coll = coll

    def stored_params(self) -> list[nn.Parameter]:
        """The parameters whose storage the stage owns (the others - frozen ones below stage 3 - stay the
        module's, replicated)."""
        return [p for gs in self._groups for p in gs.params]

    def forward_context(self) -> AbstractContextManager[None]:
        """Wraps the engine's forward (stage 3 adds a hint to errors from partitioned parameters)."""
        return nullcontext()

    @torch.no_grad()
    def full_state_dict(self, module: nn.Module, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The module's full state dict in the compute dtype, copied to the CPU of ``rank`` (of every rank
        when None; the other ranks get ``{}``). Every rank must call it (stage 3 gathers)."""
        if rank is not None and self._coll.rank != rank:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def release_params(self) -> None:
        """Before the engine is destroyed: leave the parameters usable by a later engine (the module keeps
        its flat-buffer parameters here)."""

    def refresh_frozen(self) -> None:
        """After frozen partitions were overwritten: bring their gathered copies up to date (stage 3)."""

    # The hybrid engine's one-time gather (runtime/hybrid.py).
    def partitioned_numel(self) -> int:
        """Elements a gather of every partitioned parameter holds (stage 3: its non-persistent buckets)."""
        return 0

    def hold_gathered(self, in_flight: int) -> None:
        """Gather every partitioned parameter once and keep it gathered until ``release_held``."""

    def release_held(self) -> None:
        """End ``hold_gathered``: the partitioned parameters are freed again."""

    @property
    def holding(self) -> bool:
        return False

    def unhook_inside(self, regions: Sequence[nn.Module]) -> None:
        """Compiled regions (runtime/compile.py): no module is hooked here, so there is nothing to remove."""

    def release_caches(self) -> None:
        """Return cached buffers of gathered parameters (stage 3's host pool)."""


class PartitionedParameters(WholeParameters):
    """Stage 3: each parameter is a shard of a bucket of a ``ShardedGroup``, gathered by the ``ParamGatherer``
    around its module's use; the trainable storages first, then the frozen ones (``storages``)."""

    def __init__(
        self,
        owner: object,
        storages: Sequence[Any],  # ShardedGroup (sharded.py)
        *,
        trainable: int,
        bucket_order: Sequence[BucketKey],
        gatherer: Gatherer,
        coll: Collectives,
    ) -> None:
        super().__init__(storages, coll)
        self._owner = owner  # what ZERO3_ATTR names on this placement's parameters
        self.storages = storages
        self._trainable = trainable  # storages[:trainable] are trained, the rest frozen
        self._bucket_order = bucket_order
        self.gatherer = gatherer

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:
            if str(err).startswith("ZeRO-3:"):  # our own gather errors say what happened already
                raise
            err.add_note(
                "ZeRO stage 3 hint: parameters are gathered only while their own module runs. If this forward "
                "uses a parameter outside its owning module (e.g. `x @ self.embed.weight.T` in a parent), "
                "register it once before the engine is built: "
                "ds_strategy.zero.register_external_parameter(parent_module, param)."
            )
            raise

    @torch.no_grad()
    def refresh_frozen(self) -> None:
        """After a frozen partition was overwritten (a checkpoint load): re-gather its buckets that stay
        gathered; the others are gathered from the new partition when next used."""
        coll = self._coll
        for gs in self.storages[self._trainable :]:
            gs.drop_secondaries()
            for b, live in enumerate(gs.live):
                if live:
                    mine = gs.full[b].view(coll.world_size, -1)[coll.rank]
                    gs.read_part(b, mine)
                    coll.all_gather(gs.full[b], mine)

    # ------------------------------------------------------------------ a user's gather
    def keys_for(self, params: Sequence[torch.Tensor]) -> list[BucketKey]:
        """Every bucket (persistent ones included) holding one of ``params``."""
        keys = set()
        for p in params:
            ref = getattr(p, ZERO3_ATTR, None)
            if ref is not None and ref[0] is self._owner:
                _, g, i = ref
                keys.add((g, self.storages[g].layout.params[i].bucket))
        return sorted(keys)

    def all_buckets(self) -> list[BucketKey]:
        """Every bucket of every storage (trainable in forward order, then frozen), in one agreed order."""
        trainable = list(self._bucket_order[::-1])
        frozen = [(g, b) for g in range(self._trainable, len(self.storages)) for b in range(len(self.storages[g].full))]
        return trainable + frozen

    def gather_for_user(self, keys: Sequence[BucketKey]) -> None:
        self.gatherer.acquire(keys, "GatheredParameters")

    @torch.no_grad()
    def release_for_user(self, keys: Sequence[BucketKey], modifier_rank: int | None) -> None:
        """End of GatheredParameters: take ``modifier_rank``'s edits (broadcast, re-partitioned), free."""
        if modifier_rank is not None:
            for g, b in keys:
                gs = self.storages[g]
                self._coll.broadcast(gs.full[b], src=modifier_rank)
                gs.write_back(b)
        self.gatherer.release_keys(keys)
        host_memory.trim()  # a wide gather would otherwise stay cached in the pool (see host_memory.py)

    # ------------------------------------------------------------------ the hybrid engine's hold
    def partitioned_numel(self) -> int:
        return sum(gs.full[b].numel() for gs in self.storages for b in range(len(gs.full)) if b not in gs.persistent)

    def hold_gathered(self, in_flight: int) -> None:
        keys = [(g, b) for g, b in self.all_buckets() if b not in self.storages[g].persistent]
        self.gatherer.hold(keys, in_flight=in_flight)

    def release_held(self) -> None:
        self.gatherer.unhold()

    @property
    def holding(self) -> bool:
        return self.gatherer.suspended

    def unhook_inside(self, regions: Sequence[nn.Module]) -> None:
        """See [Note: compiled regions] in module_hooks.py."""
        self.gatherer.unhook_inside(regions)

    def release_caches(self) -> None:
        host_memory.trim()

    # ------------------------------------------------------------------ whole values
    @torch.no_grad()
    def full_state_dict(self, module: nn.Module, rank: int | None = None) -> dict[str, torch.Tensor]:
        full: dict[int, torch.Tensor] = {}
        keep = rank is None or self._coll.rank == rank
        for key in self.all_buckets():  # one bucket at a time: never the whole model gathered
            self.gather_for_user([key])
            gs = self.storages[key[0]]
            if keep:
                for t in gs.bucket_tensors(key[1]):  # packed parameters' quantization state too
                    full[id(t)] = t.detach().to("cpu", copy=True)
            self.release_for_user([key], None)
        if not keep:
            return {}
        out = {}
        for name, value in module.state_dict(keep_vars=True).items():
            out[name] = full[id(value)] if id(value) in full else value.detach().to("cpu", copy=True)
        return out

    @torch.no_grad()
    def release_params(self) -> None:
        """Leave every partitioned parameter as a ``zero.Init`` shard of its current value (a collective, one
        bucket at a time; parameters of persistent buckets stay whole). The module is then what zero.Init
        would have built: a new engine (Lightning's validate after fit) or GatheredParameters takes it,
        and no parameter refers to this stage any more, so its partitions and optimizer state can go."""
        coll = Collectives(self._coll.group, fast_path=False)  # outlives this engine's collectives
        for g, gs in enumerate(self.storages):
            if gs.hands_back_whole:
                self._hand_back_whole(g, gs)
                continue
            for b, bucket in enumerate(gs.layout.buckets):
                whole = b in gs.persistent
                if not whole:
                    self.gather_for_user([(g, b)])
                for i in bucket.params:
                    p = gs.params[i]
                    if whole:
                        p.data = p.data.clone()  # off the bucket tensor this stage owns
                    else:
                        keep_shard(p, p.detach().reshape(-1), coll)
                    delattr(p, ZERO3_ATTR)
                if not whole:
                    self.release_for_user([(g, b)], None)
                    for i in bucket.params:  # release_for_user pointed them at this stage's placeholder
                        gs.params[i].data = torch.empty(0, dtype=gs.params[i].dtype, device=gs.device)

    def _hand_back_whole(self, g: int, gs: Any) -> None:
        """Packed parameters go back whole, as they came ([Note: packed partitions] in packed_store.py): one
        bucket gathered at a time, its parameters and their quantization state copied off it."""
        for b in range(len(gs.layout.buckets)):
            gathered = b not in gs.persistent
            if gathered:
                self.gather_for_user([(g, b)])
            gs.hand_back(b)
            for i in gs.layout.buckets[b].params:
                delattr(gs.params[i], ZERO3_ATTR)
            if gathered:
                self.release_for_user([(g, b)], None)
