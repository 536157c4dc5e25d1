"""What the engine needs to know about experts: where the MoE layers are, which parameters are experts,
and which communicator reduces each param group.

[Note: a param group's reduction group]
A ZeRO stage reduces, partitions and gathers each param group over one communicator. Dense groups use
the data-parallel one; a group of expert parameters (``group_name = "ep_size_<E>"``) uses the
expert-data-parallel communicator of that ``ep_size``, because the other ranks of the data-parallel group
hold *other* experts. So an MoE model's optimizer param groups must not mix the two kinds:
``split_params_into_different_moe_groups_for_optimizer`` (DeepSpeed's helper) splits them, and the engine
applies it itself to the groups it builds from ``model.parameters()`` or the config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_strategy.comm import Communicator

from .groups import ExpertGroups
from .layer import MoE

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default: elements per expert param group


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (DeepSpeed's test: ``allreduce`` set to False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every ``MoE`` layer of ``module``, in registration order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def has_moe_layers(module: nn.Module) -> tuple[bool, int]:
    """(any MoE layer?, num_experts of the first one): DeepSpeed's ``has_moe_layers``."""
    layers = moe_layers(module)
    return bool(layers), layers[0].num_experts if layers else 0


def set_expert_groups(
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
    existing: dict[int, ExpertGroups] | None = None,
    worker_from: Communicator | None = None,
) -> dict[int, ExpertGroups]:
    """Build the expert groups once per ``ep_size`` used by ``module``'s MoE layers (a collective over the
    world: call on every rank) and attach them to the layers; returns them by ``ep_size``. ``existing``:
    groups already built (reused, not rebuilt)."""
    built: dict[int, ExpertGroups] = dict(existing or {})
    for layer in moe_layers(module):
        if layer.ep_size not in built:
            built[layer.ep_size] = ExpertGroups.build(layer.ep_size, group, worker_from)
        layer.set_deepspeed_parallelism(built[layer.ep_size])
    return built


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | Sequence[dict[str, Any]], max_group_size: int | None = DEFAULT_MAX_GROUP_SIZE
) -> list[dict[str, Any]]:
    """Split each param-group dict into its dense parameters and one group per expert group name.

    The dense groups keep their place; expert groups follow, each a copy of its source group's
    hyperparameters with ``params``, ``name`` (the expert group name) and ``moe = True``, cut into groups
    of at most ``max_group_size`` elements (None: no limit). Groups left without parameters are dropped.
    """
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    dense: list[dict[str, Any]] = []
    experts: list[dict[str, Any]] = []
    for g in groups:
        params = g["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        by_name: dict[str, list[torch.Tensor]] = {}
        kept = []
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(str(getattr(p, "group_name", "")), []).append(p)
            else:
                kept.append(p)
        if kept or not by_name:
            dense.append({**g, "params": kept})
        for name, ps in by_name.items():
            for chunk in _chunks(ps, max_group_size):
                experts.append({**g, "params": chunk, "name": name, "moe": True})
    return [d for d in dense if d["params"]] + experts


def _chunks(params: list[torch.Tensor], limit: int | None) -> Iterable[list[torch.Tensor]]:
    if limit is None or limit <= 0:
        yield params
        return
    current: list[torch.Tensor] = []
    filled = 0
    for p in params:
        if current and filled + p.numel() > limit:
            yield current
            current, filled = [], 0
        current.append(p)
        filled += p.numel()
    if current:
        yield current


def group_expert_name(group: dict[str, Any], index: int) -> str | None:
    """The expert group name of a param-group dict (None: dense); a mixed group raises, naming it."""
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    names = {str(getattr(p, "group_name", "")) for p in params if is_moe_param(p)}
    if not names:
        return None
    if len(names) > 1 or len(names) != 1 or any(not is_moe_param(p) for p in params):
        raise ValueError(
            f"param group {index} mixes dense parameters and expert parameters (expert groups {sorted(names)}); "
            "each group is reduced over one process group, so build the optimizer's groups with "
            "ds_strategy.moe.split_params_into_different_moe_groups_for_optimizer(groups)"
        )
    return names.pop()


def needs_split(groups: Sequence[dict[str, Any]]) -> bool:
    """Whether some group mixes kinds (or expert group names)."""
    try:
        for i, g in enumerate(groups):
            group_expert_name(g, i)
    except ValueError:
        return True
    return False
