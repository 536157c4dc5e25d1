"""A plain torch optimizer's ``state_dict()`` written into the engine's partitioned optimizer state.

[Note: importing an unpartitioned optimizer state]
A DDP or single-process run of the same code saves ``optimizer.state_dict()``: per parameter (numbered in
the order of the optimizer's param groups) its state - per-element tensors shaped like the parameter
(Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's ``momentum_buffer``) and scalars (``step``) - plus the groups'
hyperparameters. The engine's optimizer steps flat masters instead, one per bucket of each param group,
each holding this rank's range of the group's flat layout. So the numbers are mapped to names through the
client's groups as the engine received them (same groups, same order), and every rank cuts its own flat
ranges out of the full per-parameter tensors: no communication, and the next step is the one the saving run
would have taken (the moments are not restarted). Scalars must agree across a group's parameters (one
``step`` per flat master); a parameter the saving run never stepped (it had no gradient) starts at zeros.
Per-tensor optimizers (Muon, Adafactor) and MoE expert groups keep their state by other keys and are
refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .experts import expert_group_indices
from .format import CheckpointError
from .load import copy_hyperparameters
from .target import CheckpointTarget


@torch.no_grad()
def load_torch_optimizer_state(
    engine: CheckpointTarget,
    client_names: Sequence[Sequence[str | None]],
    saved: Mapping[str, Any],
    where: str = "the optimizer state dict",
) -> None:
    """Write ``saved`` (a torch optimizer's ``state_dict()`` over the client's param groups, in the order
    ``client_names`` lists their parameters) into ``engine.optimizer``; see the note above."""
    opt = engine.optimizer
    if opt is None:
        raise CheckpointError(f"{where}: this engine has no optimizer to load it into")
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        raise CheckpointError(f"{where} is not a torch optimizer state_dict() (it needs 'state' and 'param_groups')")
    sizes = [len(g.get("params", ())) for g in groups]
    if sizes != [len(names) for names in client_names]:
        raise CheckpointError(
            f"{where} has param groups of {sizes} parameters, the optimizer this engine was given has "
            f"{[len(n) for n in client_names]}: it was saved for another model or other param groups"
        )
    if engine.stage.whole is not None or expert_group_indices(engine):
        raise CheckpointError(
            f"{where}: importing an unpartitioned optimizer state is built for element-wise optimizers over "
            "dense param groups; a per-tensor optimizer (Muon, Adafactor) or MoE expert groups keep theirs by "
            "other keys (resume from a checkpoint directory this engine saved)"
        )
    by_name: dict[str, Mapping[str, Any]] = {}
    group_of: dict[str, int] = {}
    for gi, (group, names) in enumerate(zip(groups, client_names, strict=True)):
        for number, name in zip(group["params"], names, strict=True):
            if name is not None:
                by_name[name], group_of[name] = state.get(number, {}), gi
    loaded = opt.state_dict()
    new_state: dict[int, dict[str, Any]] = {}
    index = 0
    for g, gs in enumerate(engine.stage.groups):
        slots = gs.layout.params
        missing = [s.name for s in slots if s.name not in by_name]
        if missing:
            raise CheckpointError(f"{where}: no saved state for parameters {missing[:8]} (param group {g})")
        entries = [by_name[s.name] for s in slots]
        origins = {group_of[s.name] for s in slots}
        if len(origins) == 1:
            copy_hyperparameters(loaded["param_groups"][g], groups[origins.pop()])
        stepped = [(slot, e) for slot, e in zip(slots, entries, strict=True) if e]
        if stepped:  # a parameter the saving run never stepped (no gradient yet) starts from zeros
            per_element, scalars = _split_keys(stepped, g, where)
            for b in range(len(gs.masters)):
                lo, hi = gs.master_range(b)
                entry: dict[str, Any] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}
                for key in per_element:
                    piece = torch.zeros(hi - lo, dtype=stepped[0][1][key].dtype)
                    for slot, saved_state in stepped:
                        a, z = max(lo, slot.offset), min(hi, slot.end)
                        if a < z:
                            piece[a - lo : z - lo] = saved_state[key].reshape(-1)[a - slot.offset : z - slot.offset]
                    entry[key] = piece
                new_state[index + b] = entry
        index += len(gs.masters)
    loaded["state"] = new_state
    opt.load_state_dict(loaded)


def _split_keys(
    stepped: Sequence[tuple[Any, Mapping[str, Any]]], g: int, where: str
) -> tuple[list[str], dict[str, Any]]:
    """A group's state keys: per-element (shaped like each parameter) and scalars (the same everywhere)."""
    keys = sorted({key for _, e in stepped for key in e})
    per_element, scalars = [], {}
    for key in keys:
        values = [e.get(key) for _, e in stepped]
        shaped = [
            isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(s.shape)
            for v, (s, _) in zip(values, stepped, strict=True)
        ]
        if all(shaped):
            per_element.append(key)
            continue
        first = values[0]
        same = all(_equal(v, first) for v in values)
        if not same or (isinstance(first, torch.Tensor) and first.numel() != 1):
            raise CheckpointError(
                f"{where}: optimizer state {key!r} of param group {g} is neither shaped like each parameter nor one "
                "value shared by all of them; this engine steps the group's parameters as flat masters"
            )
        scalars[key] = first
    return per_element, scalars


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b
