"""Top-1 and top-2 gating with DeepSpeed's semantics (GShard / Switch routing).

A gate maps ``S`` tokens to ``E`` experts and returns ``(l_aux, combine_weights [S,E,C], dispatch_mask
[S,E,C], exp_counts [E])``: token ``s`` goes to slot ``c`` of expert ``e`` when ``dispatch_mask[s,e,c]``,
and its output is ``sum_{e,c} combine_weights[s,e,c] * expert_out[e,c]``. ``C`` is the capacity.

- capacity: ``ceil(S / E * capacity_factor)`` (top-2: ``capacity_factor * 2``), at least ``min_capacity``;
  without ``drop_tokens`` it is the largest expert count (the maximum over the expert-parallel group, so
  every rank's dispatch tensor has one shape for the all-to-all).
- top-1 keeps, per expert, ``capacity`` of the tokens routed to it: the first ones, or with ``use_rts``
  (random token selection) the ones with the largest uniform random priority.
- top-2 drops the tokens beyond capacity in arrival order, first choices before second choices; the two
  gate values are renormalised to sum to one.
- noise: ``"Jitter"`` multiplies the gate input by ``U(1 - 1e-2, 1 + 1e-2)`` (training only); ``"RSample"``
  (top-1) picks the expert by ``argmax(logits + Gumbel)``, gate values stay the softmax of the logits;
  ``top2_2nd_expert_sampling`` picks top-2's second expert by ``argmax`` of Gumbel-perturbed logits.
- auxiliary loss (load balancing): top-1 ``E * sum_e mean_s(gates)[e] * mean_s(mask1)[e]``; top-2
  ``E * E * mean_e(...)`` of the same product (equal values: DeepSpeed's two spellings).
- ``exp_counts``: tokens routed to each expert *before* dropping (top-2 counts both choices), on the
  logits' device.

Deliberate differences from DeepSpeed: top-1's token selection takes ``min(capacity, S)`` winners (a
capacity above the token count would make ``torch.topk`` fail there); the kept tokens are the same. And
``exp_counts`` stays on the device (DeepSpeed copies it to the host, which makes every MoE forward wait for
the GPU): a training step reads nothing back (see [Note: host reads inside a step] in
accelerator/strict.py); ``.tolist()`` it where it is wanted. Without ``drop_tokens`` the capacity is the
largest expert count, a tensor shape, so that one value is read (an allowed read, counted as such).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.accelerator import strict

if TYPE_CHECKING:
    from ds_strategy.comm import Communicator

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPS = 1e-2

GateResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def multiplicative_jitter(x: torch.Tensor, epsilon: float = JITTER_EPS) -> torch.Tensor:
    """``x * U(1 - epsilon, 1 + epsilon)`` elementwise (Switch Transformer's input jitter)."""
    if epsilon == 0:
        return x
    noise = torch.rand(x.shape, device=x.device, dtype=x.dtype) * (2 * epsilon) + (1.0 - epsilon)
    return x * noise


def gumbel_rsample(shape: torch.Size | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Samples of the standard Gumbel distribution (``-log(-log(U))``)."""
    u = torch.rand(shape, device=device).clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def capacity_of(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ``ceil(num_tokens / num_experts * capacity_factor)``, at least ``min_capacity``."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), int(min_capacity))


NO_DROP_READ = "MoE without drop_tokens: the capacity (a tensor shape) is the largest expert count"


def _max_over(counts: torch.Tensor, ep_comm: Communicator | None) -> int:
    """The largest of ``counts`` over the expert-parallel group, on the host (the one read of a no-drop gate)."""
    t = counts.max().reshape(1).to(torch.int64)
    if ep_comm is not None and ep_comm.world_size > 1:
        ep_comm.all_reduce(t, "max")
    with strict.host_read_allowed(NO_DROP_READ):
        return int(t.item())


def one_hot(indices: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``F.one_hot(indices, num_classes)`` (int64) without its range check, which reads the indices' minimum
    and maximum on the host outside CUDA (the device-strict mode stands in for a GPU on the CPU)."""
    out = torch.zeros((*indices.shape, num_classes), dtype=torch.int64, device=indices.device)
    return out.scatter_(-1, indices.unsqueeze(-1), 1)


def _slots(locations_s: torch.Tensor, capacity: int) -> torch.Tensor:
    """One-hot [S, C] of each token's slot (float)."""
    return (
        one_hot(locations_s, capacity).float()
        if capacity > 0
        else locations_s.new_zeros((locations_s.shape[0], 0), dtype=torch.float32)
    )


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_comm: Communicator | None = None,
) -> GateResult:
    """Top-1 gating of ``logits`` [S, E] (see the module notes)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    if noisy_gate_policy == "RSample":
        indices1_s = torch.argmax(logits + gumbel_rsample(logits.shape, logits.device), dim=1)
    else:
        indices1_s = torch.argmax(gates, dim=1)
    mask1 = one_hot(indices1_s, num_experts)
    if used_token is not None:
        mask1 = torch.einsum("s,se->se", used_token.to(mask1.dtype), mask1)
    exp_counts = torch.sum(mask1, dim=0).detach()
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = _max_over(exp_counts, ep_comm)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if drop_tokens:
        priority = mask1 * torch.rand(mask1.shape, device=logits.device) if use_rts else mask1.float()
        if not use_rts:  # the first tokens win: a decreasing priority among the routed ones
            order = torch.arange(num_tokens, 0, -1, device=logits.device, dtype=torch.float32)
            priority = mask1 * order.unsqueeze(1)
        top_idx = torch.topk(priority, k=min(capacity, num_tokens), dim=0)[1]
        mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    gates = gates * mask1.float()
    combine_weights = torch.einsum("se,sc->sec", gates, _slots(locations1_s, capacity))
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_comm: Communicator | None = None,
    top2_2nd_expert_sampling: bool = True,
) -> GateResult:
    """Top-2 gating of ``logits`` [S, E] (see the module notes)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = one_hot(indices1_s, num_experts)
    chooser = logits.detach()
    if top2_2nd_expert_sampling:
        chooser = chooser + gumbel_rsample(logits.shape, logits.device)
    indices2_s = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = one_hot(indices2_s, num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = capacity_of(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = _max_over(exp_counts, ep_comm)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1 = torch.einsum("s,se->se", gates1_s / denom_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s / denom_s, mask2_float)
    combine_weights = torch.einsum("se,sc->sec", gates1, _slots(locations1_s, capacity)) + torch.einsum(
        "se,sc->sec", gates2, _slots(locations2_s, capacity)
    )
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


class TopKGate(nn.Module):
    """The gate: an fp32 linear map ``model_dim -> num_experts`` (``wg``, no bias) followed by top-k gating.

    In eval mode ``eval_capacity_factor`` replaces ``capacity_factor`` and no noise is added.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"TopKGate: k={k} is not supported; k must be 1 or 2")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"TopKGate: noisy_gate_policy={noisy_gate_policy!r}; valid: {NOISY_GATE_POLICIES}")
        if k == 2 and noisy_gate_policy == "RSample":
            raise ValueError(
                "TopKGate: noisy_gate_policy='RSample' is top-1 only (k=1); top-2 samples its second "
                "expert with top2_2nd_expert_sampling"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.ep_comm: Communicator | None = None  # set by the MoE layer once its groups exist

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> GateResult:
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(
                logits,
                factor,
                self.min_capacity,
                used_token,
                self.noisy_gate_policy if self.training else None,
                self.drop_tokens,
                self.use_rts,
                self.ep_comm,
            )
        return top2gating(
            logits, factor, self.min_capacity, self.drop_tokens, self.ep_comm, self.top2_2nd_expert_sampling
        )
