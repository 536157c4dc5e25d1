"""A full (consolidated, unpartitioned) state dict written into a sharded engine.

Every rank fills its fp32 masters from the full values (its own layout decides which slices), then the
stage publishes them into the parameters; buffers and frozen parameters are copied as they are. Used by
``ZeroEngine.load_full_state_dict`` (and so by the Lightning adapter for single-file checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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
    rest, aliases, keys = module_entries(engine)
    missing = [k for k in keys if k not in state_dict and aliases.get(k) not in state_dict]
    unexpected = [k for k in state_dict if k not in keys]
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
