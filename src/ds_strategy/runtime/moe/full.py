"""Whole-model values of an MoE model: every expert under its global name, as one process holds them.

[Note: global expert names]
A rank of an expert-parallel group of ``ep_size`` E holds ``num_experts / E`` experts of each MoE layer, as
``<layer>.deepspeed_moe.experts.deepspeed_experts.<local>.<suffix>``; the single-process model (``ep_size``
1) holds them all as ``...deepspeed_experts.<global>.<suffix>``, with ``global = ep_rank * num_local +
local``. So a local name means a different expert on each rank of the expert-parallel group, and every
whole-model value (``engine.full_state_dict``, ``save_16bit_model``, ``save_hf_weights``, the expert files of
a checkpoint) speaks global names, and every whole-model input (``load_full_state_dict``,
``load_hf_weights``) is read by them.

Assembling: within the expert-data-parallel group the replicas hold the same experts (a partitioned
value is first made whole there, ``ZeroStage.comm_of``); across the expert-parallel group the ranks
hold different experts, so one ``all_gather`` over the layer's expert-parallel communicator per (local
expert, entry) gives every rank all experts of a layer. That covers parameters (trainable or frozen) and
persistent buffers alike. The gathered tensors are on the module's device (what NCCL takes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .layer import MoE

EXPERTS_KEY = "deepspeed_moe.experts.deepspeed_experts."


@dataclass(frozen=True)
class ExpertKey:
    """One state-dict entry of a local expert."""

    layer: int  # the MoE layer's place among the module's MoE layers
    prefix: str  # "<layer path>.deepspeed_moe.experts.deepspeed_experts."
    local: int  # the expert's index on this rank
    suffix: str  # the entry's name inside the expert ("0.weight")
    moe: MoE

    @property
    def expert(self) -> int:
        """The global expert index."""
        return self.moe.global_expert_index(self.local)

    def name(self, expert: int | None = None) -> str:
        """The entry's global name (of ``expert``, default its own)."""
        return f"{self.prefix}{self.expert if expert is None else expert}.{self.suffix}"


def moe_layers_of(module: nn.Module) -> list[tuple[str, MoE]]:
    """(path, layer) of every MoE layer of ``module``, in registration order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def layer_prefix(path: str) -> str:
    return f"{path}.{EXPERTS_KEY}" if path else EXPERTS_KEY


class ExpertNames:
    """The expert entries of ``module``'s state dict: local name <-> global name (see the note)."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = moe_layers_of(module)
        self.local: dict[str, ExpertKey] = {}
        self.all_global: set[str] = set()
        for li, (path, layer) in enumerate(self.layers):
            prefix = layer_prefix(path)
            suffixes: list[str] = []
            experts = layer.deepspeed_moe.experts.deepspeed_experts
            for key in experts.state_dict(keep_vars=True):
                local, suffix = key.split(".", 1)
                self.local[prefix + key] = ExpertKey(li, prefix, int(local), suffix, layer)
                if int(local) == 0:
                    suffixes.append(suffix)
            self.all_global.update(f"{prefix}{e}.{s}" for e in range(layer.num_experts) for s in suffixes)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def to_global(self, key: str) -> str:
        """The global name of a local state-dict key (other keys unchanged)."""
        entry = self.local.get(key)
        return key if entry is None else entry.name()

    def full_items(
        self, items: Iterable[tuple[str, torch.Tensor]], value_of: Callable[[torch.Tensor], torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, value_of(tensor))`` for ``items`` (local state-dict keys of ``module``, the same on every
        rank, in one order), with each MoE layer's local expert entries replaced, where its first one
        stood, by every expert of the layer under its global name, in the single-process order. A
        collective over each layer's expert-parallel group: every rank calls it with the same keys."""
        pending: dict[int, list[tuple[ExpertKey, torch.Tensor]]] = {}
        ordered: list[tuple[str, torch.Tensor] | int] = []
        for key, tensor in items:
            entry = self.local.get(key)
            if entry is None:
                ordered.append((key, tensor))
                continue
            if entry.layer not in pending:
                pending[entry.layer] = []
                ordered.append(entry.layer)
            pending[entry.layer].append((entry, tensor))
        for item in ordered:
            if isinstance(item, int):
                yield from _layer_items(pending[item], value_of)
            else:
                yield item[0], value_of(item[1])


def _layer_items(
    entries: list[tuple[ExpertKey, torch.Tensor]], value_of: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every expert of one layer: each local entry gathered over the expert-parallel group."""
    layer = entries[0][0].moe
    comm = layer.deepspeed_moe.ep_comm
    ep = 1 if comm is None else comm.world_size
    per = layer.num_local_experts
    got: dict[tuple[int, str], torch.Tensor] = {}  # (global expert, suffix) -> value
    suffixes: list[str] = []
    for entry, tensor in entries:
        value = value_of(tensor)
        if entry.suffix not in suffixes:
            suffixes.append(entry.suffix)
        if ep == 1:
            got[(entry.expert, entry.suffix)] = value
            continue
        assert comm is not None
        flat = value.detach().reshape(-1).contiguous()
        out = torch.empty(ep * flat.numel(), dtype=flat.dtype, device=flat.device)
        comm.all_gather_into_tensor(out, flat)
        for r, piece in enumerate(out.view(ep, *value.shape).unbind(0)):
            got[(r * per + entry.local, entry.suffix)] = piece
    prefix = entries[0][0].prefix
    for e in range(layer.num_experts):
        for suffix in suffixes:
            found = got.get((e, suffix))
            if found is None:
                raise RuntimeError(
                    f"expert {e} of the MoE layer {prefix!r} has no {suffix!r} on any rank of its expert-parallel "
                    "group (the ranks hold different expert modules)"
                )
            yield f"{prefix}{e}.{suffix}", found


def full_state_dict(module: nn.Module, *, rank: int | None, own_rank: int) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every expert under its global name, on the CPU of ``rank`` (of every rank
    when None; ``{}`` elsewhere). Stages 0-2: the module holds whole values. A collective (every rank)."""
    names = ExpertNames(module)
    keep = rank is None or rank == own_rank
    out: dict[str, torch.Tensor] = {}
    for key, value in names.full_items(module.state_dict().items(), lambda t: t.detach()):
        if keep:
            out[key] = value.to("cpu", copy=True)
    return out
