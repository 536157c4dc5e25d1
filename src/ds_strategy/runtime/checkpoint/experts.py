"""Experts in their own checkpoint files, loadable at any ``ep_size`` and world size.

[Note: expert files]
An MoE model's expert param groups are reduced and partitioned over their expert-data-parallel group, and
the ranks of the data-parallel group hold *different* experts under the same local names
(``...deepspeed_experts.<local>.*``). So they stay out of the partitioned files and of ``meta.pt``'s
layouts, which speak of one model-wide layout; instead each expert is written whole, under its global
index, to ``expert_<layer>_<global expert>_states.pt`` (``layer``: the MoE layer's place among the
model's MoE layers):

    {"format", "version", "name": "<layer module path>.deepspeed_moe.experts.deepspeed_experts.<global>",
     "params": {suffix: {"fp32": full fp32 tensor, "state": {key: full tensor}}},
     "scalars": {key: {"value", "tensor", "dtype"}}}   # per-tensor optimizer values (step)

Saving gathers each expert group's fp32 partitions and per-element optimizer state within its
expert-data-parallel group (one all-gather per bucket and kind); that group's rank 0 writes the files of
its experts. Loading reads the files of this rank's global experts and fills each master's flat range by
the layout (so any stage 0-2, ``ep_size`` and world size reads any other). ``meta.pt`` lists, per expert
param group, its expert group name and hyperparameters (``expert_groups``) and the files under ``files``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..moe.layer import MoE
from ..zero.buffers import GroupStorage
from .format import FORMAT, VERSION, CheckpointError, expect_format, read
from .target import CheckpointTarget

EXPERTS_KEY = "deepspeed_moe.experts.deepspeed_experts."


def expert_file(layer: int, expert: int) -> str:
    return f"expert_{layer:03d}_{expert:05d}_states.pt"


@dataclass(frozen=True)
class ExpertName:
    layer: int  # index among the model's MoE layers
    expert: int  # global expert index
    suffix: str  # the parameter's name inside the expert ("0.weight")


def _layers(module: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def global_names(module: nn.Module) -> dict[str, ExpertName]:
    """Local parameter name -> (layer, global expert, suffix) for every expert parameter of ``module``."""
    out: dict[str, ExpertName] = {}
    for li, (path, layer) in enumerate(_layers(module)):
        prefix = f"{path}.{EXPERTS_KEY}" if path else EXPERTS_KEY
        for name, _ in layer.deepspeed_moe.experts.deepspeed_experts.named_parameters():
            local, suffix = name.split(".", 1)
            out[prefix + name] = ExpertName(li, layer.global_expert_index(int(local)), suffix)
    return out


def expert_group_indices(engine: CheckpointTarget) -> list[int]:
    """Indices of the stage's param groups reduced over another communicator than the engine's (experts)."""
    stage: Any = engine.stage
    comm_of = getattr(stage, "comm_of", None)
    if comm_of is None:
        return []
    return [g for g in range(len(stage.groups)) if comm_of(g) is not engine.coll]


def _full_flats(stage: Any, g: int, gs: GroupStorage, values: list[torch.Tensor]) -> torch.Tensor:
    """The whole flat layout of group ``g`` from this rank's master-shaped ``values`` (gathered over the
    group's communicator when partitioned)."""
    comm = stage.comm_of(g)
    full = torch.zeros(gs.layout.total, dtype=values[0].dtype if values else torch.float32)
    for b, value in enumerate(values):
        lo, hi = gs.master_range(b)
        bucket = gs.layout.buckets[b]
        if hi - lo == bucket.padded or comm.world_size == 1:
            full[lo:hi] = value.detach().reshape(-1).cpu()
            continue
        device = value.device
        out = torch.empty(bucket.padded, dtype=value.dtype, device=device)
        comm.all_gather(out, value.detach().reshape(-1).contiguous())
        full[bucket.start : bucket.start + bucket.padded] = out.cpu()
    return full


def gather_experts(engine: CheckpointTarget, with_optimizer: bool) -> dict[str, dict[str, Any]]:
    """{file name: content} of the expert files this rank writes (a collective over each expert group's
    communicator: every rank calls it)."""
    stage: Any = engine.stage
    names = global_names(engine.module)
    optimizer = engine.optimizer if with_optimizer else None
    files: dict[str, dict[str, Any]] = {}
    for g in expert_group_indices(engine):
        gs = stage.groups[g]
        comm = stage.comm_of(g)
        fp32 = _full_flats(stage, g, gs, [m.detach().float() for m in gs.masters])
        states = [dict(optimizer.state.get(m, {})) if optimizer is not None else {} for m in gs.masters]
        keys = sorted(states[0]) if states else []
        flats: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for key in keys:
            vals = [s[key] for s in states]
            if all(
                isinstance(v, torch.Tensor) and v.numel() == m.numel() for v, m in zip(vals, gs.masters, strict=True)
            ):
                flats[key] = _full_flats(stage, g, gs, vals)
            else:
                first = vals[0]
                scalars[key] = {
                    "value": float(first.item()) if isinstance(first, torch.Tensor) else first,
                    "tensor": isinstance(first, torch.Tensor),
                    "dtype": str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else None,
                }
        if comm.rank != 0:
            continue
        for slot in gs.layout.params:
            where = names.get(slot.name)
            if where is None:
                raise CheckpointError(f"expert param group {g} holds {slot.name!r}, which is no MoE layer's expert")
            entry = files.setdefault(
                expert_file(where.layer, where.expert),
                {"format": FORMAT, "version": VERSION, "params": {}, "scalars": scalars},
            )
            shape = tuple(slot.shape)
            entry["params"][where.suffix] = {
                "fp32": fp32[slot.offset : slot.end].clone().view(shape),
                "state": {k: v[slot.offset : slot.end].clone().view(shape) for k, v in flats.items()},
            }
    return files


class ExpertSource:
    """The expert files of a checkpoint directory, read lazily, for this engine's experts."""

    def __init__(self, tag_dir: Path, meta: dict[str, Any], module: nn.Module) -> None:
        self.tag_dir = tag_dir
        self.sizes = meta["files"]
        self.names = global_names(module)
        self._cache: dict[str, dict[str, Any]] = {}

    def _file(self, name: str) -> dict[str, Any]:
        where = self.names[name]
        fname = expert_file(where.layer, where.expert)
        if fname not in self._cache:
            if fname not in self.sizes:
                raise CheckpointError(
                    f"{self.tag_dir} has no file for expert {where.expert} of MoE layer {where.layer} ({name!r}); "
                    "the checkpoint was saved from a model with fewer experts or without MoE layers"
                )
            path = self.tag_dir / fname
            self._cache[fname] = expect_format(read(path, expected_size=self.sizes[fname]), path)
        return self._cache[fname]

    def tensor(self, name: str, kind: str | tuple[str, str]) -> torch.Tensor:
        entry = self._file(name)["params"].get(self.names[name].suffix)
        if entry is None:
            raise CheckpointError(f"the expert file of {name!r} lacks its parameter {self.names[name].suffix!r}")
        return entry["fp32"] if kind == "fp32" else entry["state"][kind[1]]

    def scalars(self, gs: GroupStorage) -> tuple[dict[str, Any], list[str]]:
        if not gs.layout.params:
            return {}, []
        data = self._file(gs.layout.params[0].name)
        first = data["params"][self.names[gs.layout.params[0].name].suffix]
        return data["scalars"], sorted(first["state"])

    def fill(self, gs: GroupStorage, kind: str | tuple[str, str], dtype: torch.dtype) -> list[torch.Tensor]:
        """Per master of ``gs``: its flat range of the layout, from the expert files (padding zero)."""
        out = []
        for b in range(len(gs.masters)):
            lo, hi = gs.master_range(b)
            piece = torch.zeros(hi - lo, dtype=dtype)
            for slot in gs.layout.params:
                a, z = max(lo, slot.offset), min(hi, slot.end)
                if a >= z:
                    continue
                src = self.tensor(slot.name, kind)
                if tuple(src.shape) != tuple(slot.shape):
                    raise CheckpointError(
                        f"{slot.name!r} has shape {list(src.shape)} in the expert file, {list(slot.shape)} in the model"
                    )
                piece[a - lo : z - lo] = src.reshape(-1)[a - slot.offset : z - slot.offset].to(dtype)
            out.append(piece)
        return out


def moe_meta(module: nn.Module) -> list[dict[str, Any]]:
    """Per MoE layer, what consolidation needs: its experts' key prefix, expert count and parameter suffixes
    (in ``state_dict`` order)."""
    out = []
    for li, (path, layer) in enumerate(_layers(module)):
        first = layer.deepspeed_moe.experts.deepspeed_experts[0]
        out.append(
            {
                "layer": li,
                "prefix": f"{path}.{EXPERTS_KEY}" if path else EXPERTS_KEY,
                "num_experts": layer.num_experts,
                "suffixes": [n for n, _ in first.named_parameters()],
            }
        )
    return out


def layer_of_key(key: str, layers: list[dict[str, Any]]) -> dict[str, Any] | None:
    for entry in layers:
        if key.startswith(entry["prefix"]):
            return entry
    return None


def expert_state(tag_dir: Path, meta: dict[str, Any], layer: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every expert of one MoE layer under its global name, fp32, from the expert files (consolidation)."""
    out = []
    for e in range(layer["num_experts"]):
        fname = expert_file(layer["layer"], e)
        if fname not in meta["files"]:
            raise CheckpointError(f"{tag_dir}: expert {e} of MoE layer {layer['layer']} has no file {fname}")
        path = tag_dir / fname
        data = expect_format(read(path, expected_size=meta["files"][fname]), path)
        for suffix in layer["suffixes"]:
            out.append((f"{layer['prefix']}{e}.{suffix}", data["params"][suffix]["fp32"]))
    return out
