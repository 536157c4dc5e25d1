"""The engine's MoE set-up (DeepSpeed's ``_configure_distributed_model`` walk): find the MoE layers, build
the expert groups once per ``ep_size``, split the param groups into dense and expert ones, and name the
communicator of each group for the ZeRO stage ([Note: a param group's reduction group] in params.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ds_strategy.comm import CommsLogger

from ..zero.collectives import Collectives
from .groups import ExpertGroups
from .layer import MoE
from .params import group_expert_name, is_moe_param, moe_layers, needs_split, set_expert_groups
from .params import split_params_into_different_moe_groups_for_optimizer as split_groups


@dataclass
class EngineMoE:
    """What the engine keeps about its MoE layers."""

    layers: list[MoE]
    groups: dict[int, ExpertGroups]  # by ep_size
    comms: dict[str, Collectives] = field(default_factory=dict)  # expert group name -> its EDP collectives

    @property
    def num_experts(self) -> list[int]:
        return [layer.num_experts for layer in self.layers]

    @property
    def gate_modules(self) -> list[nn.Module]:
        return [layer.deepspeed_moe.gate for layer in self.layers]

    @classmethod
    def create(
        cls,
        module: nn.Module,
        *,
        stage: int,
        nvme: bool,
        process_group: dist.ProcessGroup | None,
        logger: CommsLogger | None,
        coll: Collectives,
    ) -> EngineMoE | None:
        """None for a model without MoE layers; else the groups are built (a collective over the world)."""
        layers = moe_layers(module)
        if not layers:
            return None
        if stage == 3:
            raise ValueError(
                "zero_optimization.stage 3 with MoE layers is not supported by ds_strategy yet (experts would be "
                "partitioned over the whole data-parallel group); use stage 0, 1 or 2"
            )
        if nvme:
            raise ValueError(
                "NVMe offload (offload_optimizer/offload_param device 'nvme') with MoE layers is not "
                "supported; use device 'cpu' or 'none'"
            )
        existing: dict[int, ExpertGroups] = {}
        for layer in layers:  # groups a script built already (set_expert_groups) are reused
            groups = getattr(layer, "expert_groups", None)
            if isinstance(groups, ExpertGroups):
                existing.setdefault(groups.ep_size, groups)
        built = set_expert_groups(module, process_group, existing, worker_from=coll)
        comms = {g.name: Collectives(g.edp_group, logger=logger, worker_from=coll) for g in built.values()}
        return cls(layers, built, comms)

    def split(self, groups: list[dict[str, Any]], optimizer: Any) -> list[dict[str, Any]]:
        """The param groups with dense and expert parameters apart (a client optimizer must be built so)."""
        if not needs_split(groups):
            return groups
        if isinstance(optimizer, Optimizer):
            for i, g in enumerate(groups):
                group_expert_name(g, i)  # raises, naming the group and the helper to use
        return split_groups(groups)

    def group_comms(self, groups: Sequence[dict[str, Any]]) -> tuple[Collectives | None, ...]:
        """Per param group: the expert-data-parallel collectives of an expert group, None for a dense one."""
        out: list[Collectives | None] = []
        for i, g in enumerate(groups):
            name = group_expert_name(g, i)
            if name is not None and name not in self.comms:
                raise ValueError(
                    f"param group {i} holds expert parameters of group {name!r}, but the model's MoE layers use "
                    f"{sorted(self.comms)}"
                )
            out.append(None if name is None else self.comms[name])
        return tuple(out)

    def comm_for(self, param: torch.Tensor) -> Collectives | None:
        """The collectives replicating ``param`` (an expert's EDP group), None for a dense parameter."""
        if not is_moe_param(param):
            return None
        return self.comms.get(str(getattr(param, "group_name", "")))

    def comm_for_module(self, module: nn.Module) -> Collectives | None:
        """The collectives replicating ``module``'s buffers: an expert's EDP group for a module inside an
        expert, None for any other."""
        for layer in self.layers:
            experts = layer.deepspeed_moe.experts
            if any(module is m for m in experts.modules()):
                return self.comms.get(layer.expert_group_name)
        return None

    def close(self) -> None:
        for comm in self.comms.values():
            comm.close()
