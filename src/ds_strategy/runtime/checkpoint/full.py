"""A full (consolidated, unpartitioned) state dict written into a sharded engine.

Every rank fills its fp32 masters from the full values (its own layout decides which slices), then the
stage publishes them into the parameters; buffers and frozen parameters are copied as they are. Used by
``ZeroEngine.load_full_state_dict`` (and so by the Lightning adapter for single-file checkpoints). An MoE
model's experts are read under their global names, each rank taking its own experts ([Note: global expert
names] in runtime/moe/full.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..moe.full import ExpertNames
from .format import CheckpointError
from .frozen import FrozenSource, frozen_storages, read_partitions, write_partitions
from .save import module_entries
from .target import CheckpointTarget


@torch.no_grad()
def load_full_state_dict(
    engine: CheckpointTarget, state_dict: Mapping[str, Any], strict: bool = True, where: str = "the state dict"
) -> None:
    """Write a full (unpartitioned) state dict into the engine: every rank fills its fp32 masters from it,
    then publishes them into the parameters; buffers and frozen parameters are copied as they are."""
    stage = engine.stage
    names = ExpertNames(engine.module)
    rest, aliases, keys = module_entries(engine)
    known = {names.to_global(k) for k in keys} | names.all_global
    unexpected = [k for k in state_dict if k not in known]
    if names:  # the whole model's names: this rank's experts under their global ones
        state_dict = _LocalView(state_dict, names)
    missing = [names.to_global(k) for k in keys if k not in state_dict and aliases.get(k) not in state_dict]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where} does not match the model: missing keys {missing[:10]}, unexpected keys {unexpected[:10]} "
            "(strict=False loads a subset; in Lightning: LightningModule.strict_loading = False)"
        )
    for name, target in rest.items():
        if name in state_dict:
            _check_shape(state_dict[name], target.shape, name, where)
            target.copy_(state_dict[name])
    _load_frozen(engine, state_dict, aliases, where)
    for gs in stage.groups:
        # Each rank copies just the ranges its masters keep: no whole-group fp32 buffer on any rank.
        for i, name in enumerate(gs.names):
            value = state_dict.get(name)
            if value is None:
                value = next((state_dict[a] for a, n in aliases.items() if n == name and a in state_dict), None)
            if value is None:  # only when not strict: keep the current value
                continue
            slot = gs.layout.params[i]
            _check_shape(value, slot.shape, name, where)
            flat = value.reshape(-1)
            for b, master in enumerate(gs.masters):
                lo, hi = gs.master_range(b)
                a, z = max(lo, slot.offset), min(hi, slot.end)
                if a < z:
                    master.data[a - lo : z - lo].copy_(flat[a - slot.offset : z - slot.offset])
    stage.publish()
    stage.zero_grad()


class _LocalView(Mapping[str, Any]):
    """A whole-model state dict read by this rank's names: a local expert key reads its global entry."""

    def __init__(self, state_dict: Mapping[str, Any], names: ExpertNames) -> None:
        mine = {names.to_global(k): k for k in names.local}  # global -> local, this rank's experts
        self.state_dict, self.names = state_dict, names
        self.keys_ = [mine.get(k, k) for k in state_dict if k in mine or k not in names.all_global]

    def __getitem__(self, key: str) -> Any:
        return self.state_dict[self.names.to_global(key)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.names.to_global(key) in self.state_dict

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def _load_frozen(
    engine: CheckpointTarget, state_dict: Mapping[str, Any], aliases: Mapping[str, str], where: str
) -> None:
    """Stage 3's frozen partitions: each rank copies its own slices out of the full values."""
    values: dict[str, torch.Tensor] = {}
    for gs in frozen_storages(engine):
        for slot in gs.layout.params:
            value = state_dict.get(slot.name)
            if value is None:
                value = next((state_dict[a] for a, n in aliases.items() if n == slot.name and a in state_dict), None)
            if value is not None:
                _check_shape(value, slot.shape, slot.name, where)
                values[slot.name] = value
    if values:
        write_partitions(engine, read_partitions(engine, FrozenSource({}, _no_partitions, values)))


def _no_partitions(rank: int) -> dict[str, Any]:
    raise AssertionError("a full state dict has no partitions")


def _check_shape(value: Any, shape: torch.Size | tuple[int, ...], name: str, where: str) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"{where}: {name!r} is {got} in the checkpoint, {list(shape)} in the model")
