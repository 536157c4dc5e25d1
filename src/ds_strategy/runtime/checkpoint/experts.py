"""Experts in their own checkpoint files, loadable at any ``ep_size`` and world size.

[Note: expert files]
An MoE model's expert param groups are reduced and partitioned over their expert-data-parallel group, and
the ranks of the data-parallel group hold *different* experts under the same local names
(``...deepspeed_experts.<local>.*``). So they stay out of the partitioned files and of ``meta.pt``'s
layouts, which speak of one model-wide layout; instead each expert is written whole, under its global
index, to ``expert_<layer>_<global expert>_states.pt`` (``layer``: the MoE layer's place among the
model's MoE layers):

    {"format", "version",
     "params": {suffix: {"fp32": full fp32 tensor, "state": {key: full tensor}}},   # trainable
     "scalars": {key: {"value", "tensor", "dtype"}},   # per-tensor optimizer values (step)
     "module": {suffix: tensor}}   # the expert's other state-dict entries: frozen parameters, buffers

The ``"module"`` entries are this rank's experts' own (a buffer or a frozen parameter of expert 2 is not
expert 0's), so they stay out of ``model_states.pt`` (rank 0's module entries) as well.

Saving gathers each expert group's fp32 partitions and per-element optimizer state within its
expert-data-parallel group (one all-gather per bucket and kind, on the compute device: an offloaded
optimizer's host tensors are copied there first); that group's rank 0 writes the files of its experts.
Loading reads the files of this rank's global experts and fills each master's flat range by the layout
(so any stage 0-2, ``ep_size`` and world size reads any other). ``meta.pt`` lists, per expert
param group, its expert group name and hyperparameters (``expert_groups``) and the files under ``files``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..moe.full import ExpertNames
from ..moe.layer import MoE
from ..zero.buffers import GroupStorage
from .format import FORMAT, VERSION, CheckpointError, expect_format, read
from .frozen import frozen_names
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
    group's communicator when partitioned), on the host. The gather runs on the group's compute device:
    an offloaded optimizer's host tensors are copied there first (NCCL takes no host tensor)."""
    comm = stage.comm_of(g)
    full = torch.zeros(gs.layout.total, dtype=values[0].dtype if values else torch.float32)
    for b, value in enumerate(values):
        lo, hi = gs.master_range(b)
        bucket = gs.layout.buckets[b]
        if hi - lo == bucket.padded or comm.world_size == 1:
            full[lo:hi] = value.detach().reshape(-1).cpu()
            continue
        piece = value.detach().reshape(-1).to(gs.device).contiguous()
        out = torch.empty(bucket.padded, dtype=piece.dtype, device=gs.device)
        comm.all_gather(out, piece)
        full[bucket.start : bucket.start + bucket.padded] = out.cpu()
    return full


def _new_file() -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "params": {}, "scalars": {}, "module": {}}


def gather_experts(
    engine: CheckpointTarget, with_optimizer: bool, exclude_frozen: bool = False
) -> dict[str, dict[str, Any]]:
    """{file name: content} of the expert files this rank writes (a collective over each expert group's
    communicator: every rank calls it). Rank 0 of an expert-data-parallel group writes its experts'
    files: the trainable parameters' fp32 weights and optimizer state, and every other entry of the
    expert's state dict (frozen parameters, unless ``exclude_frozen``, and persistent buffers) under
    ``"module"``."""
    stage: Any = engine.stage
    names = global_names(engine.module)
    optimizer = engine.optimizer if with_optimizer else None
    files: dict[str, dict[str, Any]] = {}
    stored: set[str] = set()
    for g in expert_group_indices(engine):
        gs = stage.groups[g]
        comm = stage.comm_of(g)
        stored.update(gs.names)
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
            entry = files.setdefault(expert_file(where.layer, where.expert), _new_file())
            entry["scalars"] = scalars
            shape = tuple(slot.shape)
            entry["params"][where.suffix] = {
                "fp32": fp32[slot.offset : slot.end].clone().view(shape),
                "state": {k: v[slot.offset : slot.end].clone().view(shape) for k, v in flats.items()},
            }
    # Frozen expert parameters and expert buffers: whole on every replica (stages 0-2), this rank's experts.
    state = engine.module.state_dict(keep_vars=True)
    frozen = frozen_names(engine) if exclude_frozen else set()
    for key, held in ExpertNames(engine.module).local.items():
        if key in stored or key in frozen:
            continue
        groups = getattr(held.moe, "expert_groups", None)
        if groups is not None and groups.edp_comm.rank != 0:
            continue
        entry = files.setdefault(expert_file(held.layer, held.expert), _new_file())
        entry["module"][held.suffix] = state[key].detach().to("cpu", copy=True)
    return files


def expert_module_entries(module: nn.Module) -> set[str]:
    """The module entries (outside the stage's storage) that live in the expert files: every entry of a
    local expert's state dict (frozen parameters, buffers); the trainable ones are in the groups anyway."""
    return set(ExpertNames(module).local)


class ExpertSource:
    """The expert files of a checkpoint directory, read lazily, for this engine's experts."""

    def __init__(self, tag_dir: Path, meta: dict[str, Any], module: nn.Module) -> None:
        self.tag_dir = tag_dir
        self.sizes = meta["files"]
        self.names = global_names(module)
        self.entries = ExpertNames(module).local  # every entry of this rank's experts, by local name
        self._cache: dict[str, dict[str, Any]] = {}

    def _file(self, name: str) -> dict[str, Any]:
        where = self.names[name]
        return self._file_of(where.layer, where.expert, name)

    def _file_of(self, layer: int, expert: int, name: str) -> dict[str, Any]:
        fname = expert_file(layer, expert)
        if fname not in self._cache:
            if fname not in self.sizes:
                raise CheckpointError(
                    f"{self.tag_dir} has no file for expert {expert} of MoE layer {layer} ({name!r}); "
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

    def module_entry(self, name: str) -> torch.Tensor | None:
        """A frozen parameter or buffer of this rank's expert ``name`` (local name) from its expert file; None
        when the file does not hold it (a frozen parameter the save excluded)."""
        where = self.entries[name]
        data = self._file_of(where.layer, where.expert, name)
        return data.get("module", {}).get(where.suffix)

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
    """Per MoE layer, what consolidation needs: its experts' key prefix, expert count and entry suffixes
    (parameters and persistent buffers, in ``state_dict`` order)."""
    out = []
    for li, (path, layer) in enumerate(_layers(module)):
        first = layer.deepspeed_moe.experts.deepspeed_experts[0]
        out.append(
            {
                "layer": li,
                "prefix": f"{path}.{EXPERTS_KEY}" if path else EXPERTS_KEY,
                "num_experts": layer.num_experts,
                "suffixes": list(first.state_dict()),
            }
        )
    return out


def layer_of_key(key: str, layers: list[dict[str, Any]]) -> dict[str, Any] | None:
    for entry in layers:
        if key.startswith(entry["prefix"]):
            return entry
    return None


def expert_state(tag_dir: Path, meta: dict[str, Any], layer: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Every expert of one MoE layer under its global name, fp32 (floating entries), from the expert files
    (consolidation)."""
    excluded = set(meta.get("frozen_excluded", []))
    out = []
    for e in range(layer["num_experts"]):
        fname = expert_file(layer["layer"], e)
        if fname not in meta["files"]:
            raise CheckpointError(f"{tag_dir}: expert {e} of MoE layer {layer['layer']} has no file {fname}")
        path = tag_dir / fname
        data = expect_format(read(path, expected_size=meta["files"][fname]), path)
        for suffix in layer["suffixes"]:
            if suffix in data["params"]:
                out.append((f"{layer['prefix']}{e}.{suffix}", data["params"][suffix]["fp32"]))
                continue
            saved = data.get("module", {}).get(suffix)
            if saved is None:
                if f"{layer['prefix']}0.{suffix}" in excluded:  # a frozen parameter the save left out
                    continue
                raise CheckpointError(f"{path}: expert {e} of MoE layer {layer['layer']} lacks its entry {suffix!r}")
            out.append((f"{layer['prefix']}{e}.{suffix}", saved.float() if saved.is_floating_point() else saved))
    return out
