"""A tiny MoE model and its single-process reference (every expert in one process)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.moe import MoE

D = 8
T = 4  # tokens per sample
NUM_EXPERTS = 4
AUX = 0.01


def expert(d: int = D) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


class MoENet(nn.Module):
    """Linear -> MoE -> Linear; the loss is MSE + AUX * l_aux. Capacity is large enough that no token drops."""

    def __init__(self, ep_size: int = 1, k: int = 1, drop_tokens: bool = True, use_residual: bool = False) -> None:
        super().__init__()
        self.fc_in = nn.Linear(D, D)
        self.moe = MoE(
            D,
            expert(),
            num_experts=NUM_EXPERTS,
            ep_size=ep_size,
            k=k,
            capacity_factor=float(NUM_EXPERTS),  # every token fits (top-2: 2x that)
            min_capacity=1,
            drop_tokens=drop_tokens,
            use_residual=use_residual,
            top2_2nd_expert_sampling=False,  # deterministic routing, comparable across processes
        )
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, l_aux, counts = self.moe(torch.tanh(self.fc_in(x)))
        loss = F.mse_loss(self.head(h), y) + AUX * l_aux
        return loss, l_aux, counts


def full_model(seed: int = 0, **kw: Any) -> MoENet:
    torch.manual_seed(seed)
    return MoENet(ep_size=1, **kw)


def expert_prefix(i: int) -> str:
    return f"moe.deepspeed_moe.experts.deepspeed_experts.{i}."


def local_model(full: MoENet, ep_size: int, ep_rank: int, **kw: Any) -> MoENet:
    """A model with ep_size, holding the experts of ``ep_rank`` with ``full``'s weights."""
    model = MoENet(ep_size=ep_size, **kw)
    local = NUM_EXPERTS // ep_size
    src = full.state_dict()
    state = {}
    for name in model.state_dict():
        if name.startswith("moe.deepspeed_moe.experts.deepspeed_experts."):
            j = int(name.split(".")[4])
            rest = name[len(expert_prefix(j)) :]
            state[name] = src[expert_prefix(ep_rank * local + j) + rest].clone()
        else:
            state[name] = src[name].clone()
    model.load_state_dict(state)
    return model


def global_state(full: MoENet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in full.state_dict().items()}


def local_view(state: dict[str, torch.Tensor], ep_size: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """The entries of a full-model state dict a rank with ``ep_rank`` holds, under its local names."""
    local = NUM_EXPERTS // ep_size
    out = {}
    for name, value in state.items():
        if name.startswith("moe.deepspeed_moe.experts.deepspeed_experts."):
            g = int(name.split(".")[4])
            if g // local == ep_rank:
                out[expert_prefix(g - ep_rank * local) + name[len(expert_prefix(g)) :]] = value
        else:
            out[name] = value
    return out


def data(steps: int, rows: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, T, D, generator=g), torch.randn(rows, T, D, generator=g)) for _ in range(steps)]


def reference_run(
    full: MoENet,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    world: int | list[int],
    lr: float,
    clip: float,
) -> dict[str, Any]:
    """Single process: each step averages the per-rank losses (each rank's tokens gated on their own, as
    the distributed run does), clips by the global norm, steps AdamW. ``world``: per step, or for all."""
    model = copy.deepcopy(full)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, aux, counts, norms = [], [], [], []
    worlds = world if isinstance(world, list) else [world] * len(batches)
    for (x, y), w in zip(batches, worlds, strict=True):
        xs, ys = x.chunk(w), y.chunk(w)
        outs = [model(a, b) for a, b in zip(xs, ys, strict=True)]
        loss = sum(o[0] for o in outs) / w
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        aux.append([float(o[1].detach()) for o in outs])
        counts.append([o[2].tolist() for o in outs])
    return {"losses": losses, "aux": aux, "counts": counts, "norms": norms, "state": global_state(model)}
