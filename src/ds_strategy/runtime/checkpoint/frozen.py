"""Frozen parameters in checkpoints: stage 3's frozen partitions out, and any saved form of them back in.

[Note: frozen parameters in checkpoints]
Below stage 3 a frozen parameter is whole on every rank and rank 0 saves it in ``model_states.pt`` with
the buffers (a "module entry"). Stage 3 partitions frozen parameters (see [Note: frozen parameters] in
runtime/zero/stage3.py), so each rank saves its partition of every frozen storage, in the compute dtype,
under ``"frozen"`` in its rank file, and ``meta.pt`` records their layouts under ``"frozen_groups"``:
nothing is gathered to save a LoRA run's base. Loading takes a frozen parameter from whichever form the
checkpoint has (a partition of a saved frozen layout, re-partitioned by the same arithmetic as the
masters, or a module entry) into whichever form the engine keeps it in, so frozen parameters move across
stages and world sizes like everything else.

``exclude_frozen_parameters=True`` (DeepSpeed's ``save_checkpoint`` argument) saves neither form: an
adapters-only checkpoint. Loading one keeps the engine's frozen values (the base it was built with);
``meta["frozen_excluded"]`` lists the names left out so that loading can tell them from a mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..layout import FlatLayout
from ..packed import is_packed
from ..zero.buffers import GroupStorage
from .format import CheckpointError
from .reshard import index_by_name, read_param_range
from .target import CheckpointTarget


def frozen_storages(engine: CheckpointTarget) -> Sequence[GroupStorage]:
    """The engine's partitioned frozen storages (stage 3; none below)."""
    return tuple(getattr(engine.stage, "frozen", ()))


def frozen_names(engine: CheckpointTarget) -> set[str]:
    """Names of every frozen parameter of the module, partitioned or whole, and the entries packed ones carry."""
    return {name for name, p in engine.module.named_parameters() if not p.requires_grad} | packed_names(engine)


def packed_names(engine: CheckpointTarget) -> set[str]:
    """The state-dict entries of another library's packed quantized parameters: each parameter and the
    quantization state its library saves beside it under ``<name>.`` ([Note: packed parameters])."""
    packed = tuple(name for name, p in engine.module.named_parameters() if is_packed(p))
    if not packed:
        return set()
    prefixes = tuple(name + "." for name in packed)
    keys = engine.module.state_dict(keep_vars=True)
    return set(packed) | {key for key in keys if key.startswith(prefixes)}


def saved_partitions(engine: CheckpointTarget) -> list[torch.Tensor]:
    """This rank's partition of each frozen storage (a CPU copy with its own storage)."""
    return [gs.part.detach().to("cpu", copy=True) for gs in frozen_storages(engine)]  # type: ignore[attr-defined]


def saved_layouts(engine: CheckpointTarget) -> list[dict[str, Any]]:
    return [gs.layout.to_dict() for gs in frozen_storages(engine)]


class FrozenSource:
    """A saved checkpoint's frozen parameters by name, whether partitioned (stage 3) or module entries."""

    def __init__(
        self,
        meta: Mapping[str, Any],
        rank_data: Callable[[int], dict[str, Any]],
        entries: Mapping[str, torch.Tensor],
    ) -> None:
        self.layouts = [FlatLayout.from_dict(d) for d in meta.get("frozen_groups", [])]
        self.where = index_by_name(self.layouts)
        self.rank_data = rank_data
        self.entries = entries
        self.excluded = set(meta.get("frozen_excluded", []))

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of ``name`` in a saved frozen layout (None when it is not partitioned there)."""
        if name in self.where:
            src = self.where[name]
            return tuple(self.layouts[src.group].params[src.index].shape)
        return None

    def has(self, name: str) -> bool:
        return name in self.where or name in self.entries

    def read_range(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of the flattened saved parameter ``name`` into ``out``."""
        if name in self.where:
            src = self.where[name]
            piece = torch.empty(out.numel(), dtype=self._dtype(src.group))
            read_param_range(self.layouts[src.group], src.index, start, piece, self._partition(src.group))
            out.copy_(piece)
        else:
            out.copy_(self.entries[name].reshape(-1)[start : start + out.numel()])

    def full(self, name: str) -> torch.Tensor:
        """The saved parameter whole, in the dtype it was saved in (the compute dtype of the saving run)."""
        if name not in self.where:
            return self.entries[name]
        src = self.where[name]
        slot = self.layouts[src.group].params[src.index]
        out = torch.empty(slot.numel, dtype=self._dtype(src.group))
        read_param_range(self.layouts[src.group], src.index, 0, out, self._partition(src.group))
        return out.view(slot.shape)

    def _partition(self, group: int) -> Callable[[int], torch.Tensor]:
        return lambda rank: self.rank_data(rank)["frozen"][group]

    def _dtype(self, group: int) -> torch.dtype:
        return self.rank_data(0)["frozen"][group].dtype


def check_frozen(engine: CheckpointTarget, source: FrozenSource, where: str) -> list[str]:
    """Problems with the saved frozen parameters: missing (unless excluded on purpose) or another shape."""
    problems = []
    for gs in frozen_storages(engine):
        for slot in gs.layout.params:
            shape = source.shape(slot.name)
            if shape is None and slot.name in source.entries:
                shape = tuple(source.entries[slot.name].shape)
            if shape is None:
                if slot.name not in source.excluded:
                    problems.append(f"frozen parameter {slot.name!r} {list(slot.shape)} is not in {where}")
            elif tuple(shape) != tuple(slot.shape):
                problems.append(f"{slot.name!r} has shape {list(shape)} in the checkpoint, {list(slot.shape)} here")
    return problems


def read_partitions(engine: CheckpointTarget, source: FrozenSource) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Per frozen storage, ``(bucket, start in the partition piece, values)`` pieces of this rank's partition
    read from the checkpoint (parameters it excluded are skipped: the engine keeps its own values)."""
    out: list[list[tuple[int, int, torch.Tensor]]] = []
    for gs in frozen_storages(engine):
        pieces = []
        for b in range(len(gs.layout.buckets)):
            lo, hi = gs.layout.shard_range(b, gs.rank)
            for i in gs.layout.buckets[b].params:
                slot = gs.layout.params[i]
                a, z = max(lo, slot.offset), min(hi, slot.end)
                if a >= z or not source.has(slot.name):
                    continue
                values = torch.empty(z - a, dtype=gs.part.dtype)  # type: ignore[attr-defined]
                source.read_range(slot.name, a - slot.offset, values)
                pieces.append((b, a - lo, values))
        out.append(pieces)
    return out


@torch.no_grad()
def write_partitions(engine: CheckpointTarget, pieces: Sequence[Sequence[tuple[int, int, torch.Tensor]]]) -> None:
    """Write what ``read_partitions`` read, then refresh the frozen buckets that stay gathered (a collective)."""
    storages = frozen_storages(engine)
    for gs, group in zip(storages, pieces, strict=True):
        views = gs.layout.partition_views(gs.part)  # type: ignore[attr-defined]
        for b, start, values in group:
            views[b][start : start + values.numel()].copy_(values)
    if storages:
        engine.stage.placement.refresh_frozen()


def check_rank_file(data: Mapping[str, Any], layouts: Sequence[FlatLayout], path: str) -> None:
    frozen = data.get("frozen", [])
    if len(frozen) != len(layouts):
        raise CheckpointError(f"{path} holds {len(frozen)} frozen partitions, meta.pt lists {len(layouts)}")
    for g, (t, layout) in enumerate(zip(frozen, layouts, strict=True)):
        if t.numel() != layout.partition_numel:
            raise CheckpointError(
                f"{path}: frozen group {g} has {t.numel()} elements, its saved layout gives {layout.partition_numel}"
            )
