"""Mixture of experts: the ``MoE`` layer, its gates, the expert groups and the engine's view of them.

- ``layer.py``: ``MoE`` / ``MOELayer`` / ``Experts`` and the differentiable all-to-all.
- ``gates.py``: ``TopKGate``, ``top1gating``, ``top2gating`` (capacity, dropping, RTS, noise, aux loss).
- ``groups.py``: ``ExpertGroups`` (expert-parallel and expert-data-parallel communicators per ``ep_size``).
- ``params.py``: finding MoE layers in a model, splitting param groups into dense and expert groups, and
  the reduction communicator of each group (the only thing the ZeRO stages learn about experts).
"""

from __future__ import annotations

from .gates import TopKGate, top1gating, top2gating
from .groups import ExpertGroups, expert_group_name
from .layer import MoE, MOELayer
from .params import (
    has_moe_layers,
    is_moe_param,
    moe_layers,
    set_expert_groups,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = [
    "ExpertGroups",
    "MOELayer",
    "MoE",
    "TopKGate",
    "expert_group_name",
    "has_moe_layers",
    "is_moe_param",
    "moe_layers",
    "set_expert_groups",
    "split_params_into_different_moe_groups_for_optimizer",
    "top1gating",
    "top2gating",
]
