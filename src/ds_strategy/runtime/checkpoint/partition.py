"""A stage's part of a checkpoint: its partition of fp32 weights and optimizer state, out and back in.

[Note: what a stage provides to checkpointing]
Each entry of ``stage.groups`` exposes ``layout`` (``FlatLayout``), ``rank``, ``masters`` (one fp32 tensor
per bucket, the tensors the optimizer steps) and ``master_range(bucket)`` (the flat range of the layout
that master holds: this rank's shard in stages 1-3, the whole bucket in stage 0). After the masters are
overwritten, ``stage.publish()`` brings the compute-dtype parameters up to date. That is all: saving
takes this rank's shard of every master (so stage 0 saves exactly what stage 1 would), loading fills
each master's range through [Note: resharding].

Optimizer state is stored without reference to the optimizer's implementation: per param group, every
state tensor with one value per element (``exp_avg``, ``exp_avg_sq``, ``sum``, ``momentum_buffer``) as a
flat partition, and every per-tensor value (``step``) once, with whether it was a tensor. Loading builds
a ``torch.optim`` state dict from these and hands it to ``optimizer.load_state_dict``, which places each
value where that optimizer keeps it (a fused AdamW keeps ``step`` on the parameter's device).

A per-tensor optimizer ([Note: per-tensor optimizers under ZeRO]) keeps state of any shape (Adafactor's
row and column factors), so its state is stored by parameter name instead (``"tensors"``), by the rank
whose shard holds the parameter; a load at any world size or stage finds each parameter's entry through
the saved layout (``FlatLayout.owner``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from ..layout import FlatLayout
from ..zero.buffers import GroupStorage
from ..zero.per_tensor import WholeTensors
from .format import CheckpointError
from .reshard import SavedParam, fill_flat_range


def _rank_shard(gs: GroupStorage, bucket: int, value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``bucket`` out of a master-shaped tensor."""
    lo, _ = gs.master_range(bucket)
    s_lo, s_hi = gs.layout.shard_range(bucket, gs.rank)
    return value.reshape(-1)[s_lo - lo : s_hi - lo]


def _cat(pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if not pieces:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([p.detach().to("cpu") for p in pieces])  # a fresh tensor: never saves a larger storage


def saved_group(gs: GroupStorage, optimizer: Optimizer | None, whole: WholeTensors | None = None) -> dict[str, Any]:
    """``{"fp32": partition, "state": {key: partition}, "scalars": {key: {...}}}`` of one param group; with a
    per-tensor optimizer's tensors (``whole``), ``{"fp32": ..., "tensors": {name: state}}`` instead."""
    fp32 = _cat([_rank_shard(gs, b, m.detach().float()) for b, m in enumerate(gs.masters)], torch.float32)
    if whole is not None:
        return {"fp32": fp32, "state": {}, "scalars": {}, "tensors": _named_states(gs, optimizer, whole)}
    states = [dict(optimizer.state.get(m, {})) if optimizer is not None else {} for m in gs.masters]
    keys = sorted(states[0]) if states else []
    for b, s in enumerate(states):
        if sorted(s) != keys:
            raise CheckpointError(
                f"optimizer state of param group {gs.index}: bucket {b} holds keys {sorted(s)}, bucket 0 holds "
                f"{keys}; every bucket of a group must have stepped together"
            )
    flat: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for key in keys:
        values = [s[key] for s in states]
        per_element = all(
            isinstance(v, torch.Tensor) and v.numel() == m.numel() for v, m in zip(values, gs.masters, strict=True)
        )
        if per_element:
            flat[key] = _cat([_rank_shard(gs, b, v) for b, v in enumerate(values)], values[0].dtype)
            continue
        plain = [float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in values]
        if any(isinstance(v, torch.Tensor) for v in plain) or any(v != plain[0] for v in plain):
            raise CheckpointError(
                f"optimizer state {key!r} of param group {gs.index} is neither one value per element nor one "
                "value shared by every bucket; this optimizer's state cannot be partitioned"
            )
        first = values[0]
        scalars[key] = {
            "value": plain[0],
            "tensor": isinstance(first, torch.Tensor),
            "dtype": str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else None,
        }
    return {"fp32": fp32, "state": flat, "scalars": scalars}


def _named_states(gs: GroupStorage, optimizer: Optimizer | None, whole: WholeTensors) -> dict[str, dict[str, Any]]:
    """The optimizer state of each parameter this rank's shard holds, by name (CPU copies)."""
    out: dict[str, dict[str, Any]] = {}
    if optimizer is None:
        return out
    for i, slot in enumerate(gs.layout.params):
        tensor = whole.tensor_of(gs.index, i)
        if gs.layout.owner(i) != gs.rank or tensor is None:
            continue  # stage 0 holds every parameter: the owner in the layout saves it, as at stage 1
        out[slot.name] = {
            k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in optimizer.state.get(tensor, {}).items()
        }
    return out


class Source:
    """The saved side of a load: layouts, where each parameter is, and lazy access to rank partitions."""

    def __init__(self, layouts: Sequence[FlatLayout], rank_data: Callable[[int], dict[str, Any]]) -> None:
        self.layouts = list(layouts)
        self.where: dict[str, SavedParam] = {
            slot.name: SavedParam(g, i) for g, layout in enumerate(self.layouts) for i, slot in enumerate(layout.params)
        }
        self.rank_data = rank_data

    def partition(self, kind: str | tuple[str, str]) -> Callable[[int, int], torch.Tensor]:
        """``(group, rank) -> flat partition`` of ``"fp32"`` or ``("state", key)``."""

        def get(group: int, rank: int) -> torch.Tensor:
            saved = self.rank_data(rank)["groups"][group]
            return saved["fp32"] if kind == "fp32" else saved["state"][kind[1]]

        return get

    def scalars_for(self, layout: FlatLayout, group: int) -> tuple[int | None, dict[str, Any], list[str]]:
        """(saved group, scalars, flat state keys) that a new group inherits: those of its parameters' saved
        group, which must be one and the same for all of them."""
        origins = sorted({self.where[slot.name].group for slot in layout.params})
        if not origins:
            return None, {}, []
        first = self.rank_data(0)["groups"]
        keys = {g: (sorted(first[g]["state"]), first[g]["scalars"]) for g in origins}
        if len({repr(v) for v in keys.values()}) > 1:
            raise CheckpointError(
                f"param group {group} takes parameters from saved groups {origins}, whose optimizer states differ "
                f"({keys}); keep the parameters of one saved group together"
            )
        g = origins[0]
        return g, first[g]["scalars"], sorted(first[g]["state"])

    def per_tensor(self, group: int) -> bool:
        """Whether saved group ``group`` holds per-tensor state by name (``"tensors"``)."""
        return "tensors" in self.rank_data(0)["groups"][group]

    def tensor_state(self, name: str, where: str) -> dict[str, Any]:
        """Parameter ``name``'s saved per-tensor optimizer state (empty before the first step)."""
        saved = self.where[name]
        layout = self.layouts[saved.group]
        rank = layout.owner(saved.index)
        groups = self.rank_data(0 if rank is None else rank)["groups"]
        if rank is None or "tensors" not in groups[saved.group]:
            raise CheckpointError(
                f"{where} holds element-wise optimizer state (flat partitions) for {name!r}, but this optimizer "
                "steps whole tensors (Muon, Adafactor ...); pass load_optimizer_states=False to load the weights only"
            )
        return dict(groups[saved.group]["tensors"].get(name, {}))

    def state_dtype(self, group: int, key: str) -> torch.dtype:
        return self.rank_data(0)["groups"][group]["state"][key].dtype

    def fill(self, gs: GroupStorage, kind: str | tuple[str, str], dtype: torch.dtype) -> list[torch.Tensor]:
        """Per bucket of ``gs``, a CPU tensor holding the saved values of that master's flat range."""
        out = []
        for b in range(len(gs.masters)):
            lo, hi = gs.master_range(b)
            piece = torch.empty(hi - lo, dtype=dtype)
            fill_flat_range(gs.layout, lo, piece, saved=self.layouts, where=self.where, partition=self.partition(kind))
            out.append(piece)
        return out


def scalar_value(entry: dict[str, Any]) -> Any:
    if entry["tensor"]:
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]))
    return entry["value"]
