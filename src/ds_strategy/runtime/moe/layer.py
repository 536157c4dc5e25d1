"""``MoE``: DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``) on ds_strategy's comm.

    moe = MoE(hidden_size=64, expert=MLP(64), num_experts=8, ep_size=2, k=2)
    out, l_aux, exp_counts = moe(hidden_states)          # hidden_states [..., hidden_size]
    loss = task_loss(out) + 0.01 * l_aux

Module tree (DeepSpeed's names, so state dicts line up): ``moe.deepspeed_moe`` (``MOELayer``) holds
``gate`` (``TopKGate``, its ``wg``) and ``experts`` (``Experts``: ``deepspeed_experts.<i>``, the
``num_experts / ep_size`` experts of this rank, each a deep copy of ``expert``); with ``use_residual``
also ``mlp`` (a copy of ``expert``, dense) and ``coefficient`` (``Linear(hidden_size, 2)``).

Forward: the gate routes the flattened tokens [S, M] to ``dispatched [E, C, M]``; with ``ep_size`` > 1 an
all-to-all over the expert-parallel group gives each rank the slots of its own experts from every rank
([ep_size, local, C, M] by source rank), the local experts run, and a second all-to-all sends
the outputs back. Gradients take the same path backwards (the all-to-all's adjoint is an all-to-all).

Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_<E>"`` (DeepSpeed's tags); the
engine reads them to reduce those gradients inside the expert-data-parallel group.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.comm import Communicator

from .gates import TopKGate
from .groups import ExpertGroups, expert_group_name


class _AllToAll(torch.autograd.Function):
    """All-to-all along dim 0 over a communicator; backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, comm: Communicator, input: torch.Tensor) -> torch.Tensor:
        ctx.comm = comm
        input = input.contiguous()
        output = torch.empty_like(input)
        comm.all_to_all_single(output, input)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.comm, grad)


def all_to_all(comm: Communicator | None, x: torch.Tensor) -> torch.Tensor:
    """Differentiable all-to-all of ``x`` along dim 0 (identity for no communicator or a group of one)."""
    if comm is None or comm.world_size == 1:
        return x
    return _AllToAll.apply(comm, x)


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``; input [..., local, C, M]: expert i gets ``[:, i]``."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts, strict=True):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            outs.append(out)
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """Gate + experts + the two all-to-alls (DeepSpeed's ``MOELayer``)."""

    def __init__(
        self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_comm: Communicator | None = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, comm: Communicator | None) -> None:
        self.ep_comm = comm
        self.gate.ep_comm = comm

    def forward(self, hidden: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_comm is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group yet: wrap the model with "
                "ds_strategy.initialize(...) (it builds the groups), or call "
                "ds_strategy.moe.set_expert_groups(model) on every rank first"
            )
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(tokens), tokens)
        dispatched = all_to_all(self.ep_comm, dispatched)
        # [ep_size (source rank), local expert, C, M]: the experts take their slice of dim 1
        out = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model))
        out = all_to_all(self.ep_comm, out)  # piece j (dim 0) back to source rank j
        out = out.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(tokens), out)
        return combined.reshape(hidden.shape)


class MoE(nn.Module):
    """DeepSpeed's ``MoE`` layer; ``forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)``."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
            raise ValueError(
                f"MoE: num_experts={num_experts} must be a positive multiple of ep_size={ep_size} "
                "(each expert-parallel rank holds num_experts / ep_size experts)"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = expert_group_name(ep_size)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, groups: ExpertGroups | None) -> None:
        """Attach this rank's expert groups (None only for ep_size 1 without torch.distributed)."""
        if groups is not None and groups.ep_size != self.ep_size:
            raise ValueError(f"MoE layer has ep_size={self.ep_size}, the groups given are for {groups.ep_size}")
        self.deepspeed_moe._set_ep_group(None if groups is None else groups.ep_comm)
        self.expert_groups = groups

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group (which experts it holds); 0 at ``ep_size`` 1."""
        comm = self.deepspeed_moe.ep_comm
        if comm is None and self.ep_size > 1:  # which experts this rank holds is not known yet
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group yet: wrap the model with "
                "ds_strategy.initialize(...) (it builds the groups), or call "
                "ds_strategy.moe.set_expert_groups(model) on every rank first"
            )
        return 0 if comm is None else comm.rank

    def global_expert_index(self, local: int) -> int:
        """The global index of this rank's local expert ``local``."""
        return self.ep_rank * self.num_local_experts + local

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            mlp_out = self.mlp(hidden_states)
            if isinstance(mlp_out, tuple):
                mlp_out = mlp_out[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp_out * coef[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
