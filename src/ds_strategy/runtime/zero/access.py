"""Full-state access: one trainable parameter's fp32 weight, reduced gradient and optimizer state, at any stage.

What ``ds_strategy.utils``' ``safe_get_*`` / ``safe_set_*`` functions (``runtime/full_state.py``) and the
Lightning precision plugin's gradient hook window (``visible_grads``) read and write.

[Note: where a parameter's state lives]
A trainable parameter is one slot of its group's flat layout (``runtime/layout.py``). Each rank's masters
cover a flat range per bucket (``GroupStorage.master_range``): the whole bucket at stage 0, this rank's
shard at stages 1-3. The parameter's *fragment* on this rank is the overlap of its slot with that range:
the whole parameter at stage 0, any contiguous part of it (possibly nothing) at stages 1-3, at the same
offset in the master, in the optimizer's state tensors (shaped like the master) and in the reduced
gradient (``ZeroStage.reduced_grads_of``, lined up with the masters). So

- a *local* value is the fragment (1-D; rank r's fragments, concatenated in rank order, are the
  flattened parameter, since shards are contiguous runs of the flat buffer in rank order), and
- a *full* value is every rank's fragment put in place: one ``all_reduce`` of a zero-filled tensor that
  each rank fills with its own fragment (sums with zeros are exact), none at stage 0. The ranks are those
  of the group's own communicator (``ZeroStage.comm_of``): an expert group of an MoE model is partitioned
  over its expert-data-parallel communicator, whose ranks hold the same experts; the other ranks of the
  data-parallel group hold *other* experts under the same names, so summing over them would mix experts.
  A local fragment likewise is a piece of that communicator's rank order.

Gradients are stored scaled (x loss scale, with the averaging folded into the step: see
``ZeroStage.options``); ``grad_factor`` turns them into the averaged, unscaled gradient DDP would hold.

[Note: finding a parameter's engine]
``FullStateAccess.attach`` sets ``param._ds_access`` to a small ``ParamLink`` (this object, group, index)
on every parameter the engine trains, and ``detach`` (engine.destroy) removes it: no global registry.
A link pickles and deep-copies to a dead link (``torch.save(model)``, ``copy.deepcopy``), a lookup
checks that the link's slot still holds this very parameter, so a copy never reaches the old engine, and
the access holds its engine weakly, so the links never keep a dropped engine's state alive.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from .base import ZeroStage
from .buffers import GroupStorage
from .buffers import param_fragment as _fragment
from .intake import GradStatus
from .sharded import ShardedGroup

_T = TypeVar("_T")

ACCESS_ATTR = "_ds_access"  # on each trainable parameter: its ParamLink

Kind = Literal["fp32_param", "grad", "optimizer_state"]


class _Owner(Protocol):
    """What the access needs of the engine (``ZeroEngine``)."""

    stage: ZeroStage
    optimizer: Optimizer | None

    @property
    def loss_scale(self) -> float: ...

    def is_gradient_accumulation_boundary(self) -> bool: ...


class ParamLink:
    """``param._ds_access``: the parameter's engine access and slot (see [Note: finding a parameter's engine])."""

    __slots__ = ("access", "group", "index")

    def __init__(self, access: FullStateAccess | None, group: int, index: int) -> None:
        self.access, self.group, self.index = access, group, index

    def __reduce__(self) -> tuple[Any, ...]:
        return (ParamLink, (None, -1, -1))  # a pickled or copied parameter belongs to no engine


def find(param: torch.Tensor) -> tuple[FullStateAccess, int, int] | None:
    """(access, group, index) of a parameter an engine trains; None for any other tensor."""
    link = getattr(param, ACCESS_ATTR, None)
    if not isinstance(link, ParamLink) or link.access is None or not link.access.alive:
        return None
    groups = link.access.stage.groups
    if link.group >= len(groups) or link.index >= len(groups[link.group].params):
        return None
    if groups[link.group].params[link.index] is not param:
        return None
    return link.access, link.group, link.index


def _resident(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a full-state method with NVMe-offloaded state in memory (``ZeroStage.resident``)."""

    @functools.wraps(method)
    def run(self: FullStateAccess, *args: Any, **kwargs: Any) -> _T:
        with self.stage.resident():
            return method(self, *args, **kwargs)

    return run


class FullStateAccess:
    """Reads and writes one engine's per-parameter state (see the notes above)."""

    def __init__(self, owner: _Owner) -> None:
        # Weak: the parameters' links must not keep a dropped engine (its masters, optimizer state) alive.
        self._owner = weakref.ref(owner)
        self._stage = weakref.ref(owner.stage)

    @property
    def alive(self) -> bool:
        return self._owner() is not None

    @property
    def owner(self) -> _Owner:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the ZeRO engine of this parameter was garbage-collected")
        return owner

    @property
    def stage(self) -> ZeroStage:
        stage = self._stage()
        if stage is None:
            raise RuntimeError("the ZeRO engine of this parameter was garbage-collected")
        return stage

    # ------------------------------------------------------------------ links
    def attach(self) -> None:
        for g, gs in enumerate(self.stage.groups):
            for i, p in enumerate(gs.params):
                setattr(p, ACCESS_ATTR, ParamLink(self, g, i))

    def detach(self) -> None:
        for gs in self.stage.groups:
            for p in gs.params:
                link = getattr(p, ACCESS_ATTR, None)
                if isinstance(link, ParamLink) and link.access is self:
                    delattr(p, ACCESS_ATTR)

    # ------------------------------------------------------------------ where values are
    def name(self, group: int, index: int) -> str:
        return self.stage.groups[group].names[index]

    def grad_factor(self) -> float:
        """Stored gradient -> averaged, unscaled gradient (what the step multiplies by before clipping)."""
        return self.stage.options.post_scale / self.owner.loss_scale

    def _source(self, group: int, bucket: int, kind: Kind, key: str | None, index: int) -> torch.Tensor:
        """The tensor lined up with ``masters[bucket]`` of ``group`` that holds ``kind``."""
        gs = self.stage.groups[group]
        master = gs.masters[bucket]
        if kind == "fp32_param":
            return master.detach()
        if kind == "grad":
            return self.stage.reduced_grads_of(group)[bucket]
        advice = (
            "only states shaped like the parameter (exp_avg, exp_avg_sq, momentum_buffer ...) are partitioned with it"
        )
        return self._state_value(master, key, group, index, advice)

    def _piece(self, group: int, bucket: int, kind: Kind, key: str | None, index: int, at: int, n: int) -> torch.Tensor:
        """Parameter ``index``'s ``n`` elements of ``kind`` at offset ``at`` of ``masters[bucket]`` (a view)."""
        whole = self.stage.whole
        if kind != "optimizer_state" or whole is None or group not in whole.groups:
            return self._source(group, bucket, kind, key, index)[at : at + n]
        # A per-tensor optimizer keys its state by the whole tensor (per_tensor.py): the fragment is all of it.
        tensor = whole.tensor_of(group, index)
        assert tensor is not None and n == tensor.numel()
        advice = "read the optimizer's own state for factored or per-tensor values"
        return self._state_value(tensor, key, group, index, advice).view(-1)

    def _state_value(self, tensor: torch.Tensor, key: str | None, group: int, index: int, advice: str) -> torch.Tensor:
        """``optimizer.state[tensor][key]``, a tensor shaped like ``tensor``; else an error naming the parameter
        and what exists (``advice``: what to do about a state of another shape)."""
        optimizer = self.owner.optimizer
        if optimizer is None:
            raise RuntimeError(
                f"optimizer state {key!r} of parameter {self.name(group, index)!r}: this engine has no optimizer"
            )
        state = optimizer.state.get(tensor, {})
        value = state.get(key)
        if value is None:
            raise KeyError(
                f"optimizer state {key!r} of parameter {self.name(group, index)!r} does not exist: "
                + (
                    f"the optimizer holds {sorted(state)}"
                    if state
                    else "the optimizer creates its state in its first step; read it after engine.step()"
                )
            )
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            raise ValueError(
                f"optimizer state {key!r} of parameter {self.name(group, index)!r} is not a per-element tensor "
                f"(got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}); {advice}"
            )
        return value

    def _factor(self, kind: Kind, what: str) -> float:
        if kind != "grad":
            return 1.0
        self.require_grads(what)
        return self.grad_factor()

    def require_grads(self, what: str) -> None:
        """Raise unless the window's reduced gradients can be read now; reduce them first (a collective,
        as ``engine.step()`` would) when the boundary backward did not."""
        status = self.stage.intake.status()
        if status is GradStatus.REDUCED:
            return
        if status is GradStatus.IN_BACKWARD:
            raise RuntimeError(f"{what}: not available while backward runs; call it after engine.backward()")
        if status is GradStatus.NONE:
            raise RuntimeError(
                f"{what}: no gradient since the last optimizer step; gradients are available after "
                "engine.backward() at the accumulation boundary and before engine.step()"
            )
        if not self.owner.is_gradient_accumulation_boundary():
            raise RuntimeError(
                f"{what}: at ZeRO stage {self.stage.stage} gradients are reduced across ranks only by the backward "
                "that ends the accumulation window; read them after that backward and before engine.step()"
            )
        self.stage.reducer.catch_up()  # loss.backward() outside engine.backward: reduce now, as step() would

    # ------------------------------------------------------------------ full values (collectives at stages 1-3)
    @_resident
    def get_full(self, group: int, index: int, kind: Kind, key: str | None = None) -> torch.Tensor:
        """The parameter's whole ``kind`` in fp32, shaped like the parameter; every rank must call it
        (stages 1-3 all-reduce)."""
        factor = self._factor(kind, f"the full gradient of {self.name(group, index)!r}")
        gs = self.stage.groups[group]
        slot = gs.layout.params[index]
        out = torch.zeros(slot.numel, dtype=torch.float32, device=gs.device)
        frag = _fragment(gs, index)
        if frag is not None:
            b, at, start, n = frag
            out[start : start + n].copy_(self._piece(group, b, kind, key, index, at, n))
        elif (
            kind == "optimizer_state"
            and gs.masters
            and (self.stage.whole is None or group not in self.stage.whole.groups)
        ):
            # no piece here: check the key as the ranks with one do, so that all raise rather than some waiting
            self._source(group, 0, kind, key, index)
        comm = self.stage.comm_of(group)  # an expert group's own (expert-data-parallel) communicator
        if gs.partitioned and comm.world_size > 1:
            comm.all_reduce(out)
        if factor != 1.0:
            out.mul_(factor)
        return out.view(slot.shape)

    @torch.no_grad()
    @_resident
    def set_full(self, group: int, index: int, value: torch.Tensor, kind: Kind, key: str | None = None) -> None:
        """Write the parameter's whole ``kind`` (every rank passes the same value; no communication)."""
        factor = self._factor(kind, f"setting the full gradient of {self.name(group, index)!r}")
        gs = self.stage.groups[group]
        slot = gs.layout.params[index]
        flat = self._flat(value, slot.numel, group, index, f"shaped like the parameter {slot.shape}")
        frag = _fragment(gs, index)
        if frag is not None:
            b, at, start, n = frag
            self._piece(group, b, kind, key, index, at, n).copy_(flat[start : start + n] / factor)
        if kind == "fp32_param":
            self._write_compute(gs, index, 0, flat)

    # ------------------------------------------------------------------ this rank's fragment (no communication)
    def local_numel(self, group: int, index: int) -> int:
        frag = _fragment(self.stage.groups[group], index)
        return 0 if frag is None else frag[3]

    @_resident
    def get_local(self, group: int, index: int, kind: Kind, key: str | None = None) -> torch.Tensor:
        """This rank's fragment of ``kind`` in fp32 (1-D, possibly empty), a copy."""
        factor = self._factor(kind, f"the local gradient of {self.name(group, index)!r}")
        gs = self.stage.groups[group]
        frag = _fragment(gs, index)
        if frag is None:
            return torch.zeros(0, dtype=torch.float32, device=gs.device)
        b, at, _, n = frag
        out = self._piece(group, b, kind, key, index, at, n).to(gs.device, torch.float32, copy=True)
        return out.mul_(factor) if factor != 1.0 else out

    @torch.no_grad()
    @_resident
    def set_local(self, group: int, index: int, value: torch.Tensor, kind: Kind, key: str | None = None) -> None:
        """Write this rank's fragment of ``kind`` (``value`` has ``local_numel`` elements)."""
        factor = self._factor(kind, f"setting the local gradient of {self.name(group, index)!r}")
        gs = self.stage.groups[group]
        frag = _fragment(gs, index)
        numel = 0 if frag is None else frag[3]
        flat = self._flat(value, numel, group, index, "this rank's fragment (see safe_get_local_fp32_param)")
        if frag is None:
            return
        b, at, start, n = frag
        self._piece(group, b, kind, key, index, at, n).copy_(flat / factor)
        if kind == "fp32_param":
            self._write_compute(gs, index, start, flat)

    # ------------------------------------------------------------------ helpers
    def _flat(self, value: torch.Tensor, numel: int, group: int, index: int, expected: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"value for parameter {self.name(group, index)!r} must be a tensor, got {type(value)}")
        if value.numel() != numel:
            raise ValueError(
                f"value for parameter {self.name(group, index)!r} has {value.numel()} elements, expected {numel} "
                f"({expected})"
            )
        return value.detach().reshape(-1).to(self.stage.groups[group].device, torch.float32)

    @staticmethod
    def _write_compute(gs: GroupStorage, index: int, start: int, values: torch.Tensor) -> None:
        """Put parameter ``index``'s new elements ``[start, start + len(values))`` into the compute-dtype copies
        this rank holds: the parameter itself at stages 0-2; at stage 3 its fragment of the partition and,
        while its bucket is gathered, the gathered copy - so the next forward uses them."""
        end = start + values.numel()
        if not isinstance(gs, ShardedGroup):
            gs.params[index].data.view(-1)[start:end].copy_(values)
            return
        frag = _fragment(gs, index)
        if frag is not None:
            b, at, fs, n = frag
            a, z = max(start, fs), min(end, fs + n)
            if a < z:
                part = gs.layout.partition_view(gs.part, b)
                part[at + a - fs : at + z - fs].copy_(values[a - start : z - start])
        bucket = gs.layout.params[index].bucket
        if gs.live[bucket]:
            gs.in_bucket(gs.full[bucket], index).view(-1)[start:end].copy_(values)

    # ------------------------------------------------------------------ gradients as p.grad (Lightning's hooks)
    @contextmanager
    def visible_grads(self) -> Iterator[None]:
        """Every trainable parameter's averaged, unscaled gradient as ``p.grad`` (its dtype) for the block, as
        DDP would hold it; a collective at stages 1-3 (one all-gather per bucket).

        [Note: gradients as p.grad]
        The engine's hooks take every gradient out of ``p.grad`` into its buffers, so code that reads
        ``p.grad`` (Lightning's ``grad_norm``, a custom clipping callback) sees nothing. Inside this block it
        does: the full gradients exist at once, one copy of the trainable parameters in their dtype (at
        stage 3 the whole model's gradient, beside the partitions). At stage 3 a parameter outside a gather
        is a 0-element placeholder, and torch refuses a gradient of another size; the gradient is assigned
        while ``p.data`` is briefly a zero-stride expansion of one element (no memory), so ``p.grad`` has the
        parameter's true shape while ``p.data`` stays the placeholder. A gradient changed in the block (in
        place, seen by its version counter, or replaced) is written back into the reduced gradient the step
        uses; at 16-bit that write rounds the fp32 gradient to the parameter's dtype. Setting ``p.grad`` to
        None does not skip the parameter: the reduced gradient is kept. On leaving, ``p.grad`` is None again.
        """
        status = self.stage.intake.status()
        if status is GradStatus.NONE:  # nothing to show (a skipped step raises its own error afterwards)
            yield
            return
        with self.stage.resident(), self._visible_grads():  # NVMe offload: the gradients in memory meanwhile
            yield

    @contextmanager
    def _visible_grads(self) -> Iterator[None]:
        self.require_grads("gradients as p.grad")
        factor = self.grad_factor()
        shown: list[tuple[nn.Parameter, torch.Tensor, int, int, int]] = []  # (param, grad, version, group, index)
        try:
            with torch.no_grad():
                for g, gs in enumerate(self.stage.groups):
                    pieces = self.stage.reduced_grads_of(g)
                    for b, bucket in enumerate(gs.layout.buckets):
                        full = self._bucket_grad(g, b, pieces[b])
                        for i in bucket.params:
                            slot, p = gs.layout.params[i], gs.params[i]
                            piece = full[slot.offset - bucket.start : slot.end - bucket.start].view(slot.shape)
                            grad = (piece * factor).to(p.dtype) if factor != 1.0 else piece.to(p.dtype, copy=True)
                            _assign_grad(p, grad)
                            shown.append((p, grad, grad._version, g, i))
            yield
            for p, grad, version, g, i in shown:
                now = p.grad
                if now is not None and (now is not grad or now._version != version):
                    self.set_full(g, i, now, "grad")
        finally:
            for p, *_ in shown:
                p.grad = None

    def _bucket_grad(self, group: int, bucket: int, piece: torch.Tensor) -> torch.Tensor:
        """The bucket's whole stored gradient (stage 0 holds it; stages 1-3 all-gather the shards over the
        group's own communicator: an expert group's is its expert-data-parallel one)."""
        gs = self.stage.groups[group]
        comm = self.stage.comm_of(group)
        if not gs.partitioned or comm.world_size == 1:
            return piece
        # On the compute device: an offloaded optimizer's gradient partitions are host tensors (NCCL takes none).
        full = torch.empty(gs.layout.buckets[bucket].padded, dtype=torch.float32, device=gs.device)
        comm.all_gather(full, piece.to(gs.device, torch.float32))
        return full


def _assign_grad(p: nn.Parameter, grad: torch.Tensor) -> None:
    """``p.grad = grad``, also for a stage-3 placeholder of another shape (see [Note: gradients as p.grad])."""
    if p.shape == grad.shape:
        p.grad = grad
        return
    placeholder = p.data
    p.data = torch.empty((), dtype=p.dtype, device=p.device).expand(grad.shape)
    try:
        p.grad = grad
    finally:
        p.data = placeholder
