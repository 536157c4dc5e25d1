"""The differentiable all-to-all of Ulysses: scatter one dim over the group, gather another.

``seq_all_to_all(x, group, scatter_idx, gather_idx)`` on P ranks: every rank cuts dim ``scatter_idx`` of
its ``x`` into P equal pieces and sends piece j to group rank j; every rank concatenates, along dim
``gather_idx``, the pieces it receives in rank order. Before attention it trades a sequence shard for a
head shard (scatter heads, gather sequence), after attention the reverse.

The exchange is a permutation of the group's elements, so its adjoint is its inverse: the backward of
(scatter s, gather g) is the exchange (scatter g, gather s) of the incoming gradient.

One implementation for any layout: the scatter dim is moved to the front and made contiguous, so the
equal split along dim 0 of ``all_to_all_single`` cuts it (DeepSpeed special-cases each layout instead);
the received ``[P, ...]`` block is then folded into the gather dim.

``seq_all_to_all_many`` sends several tensors (query, key and value) in one exchange: each one's scatter
dim is cut into its P pieces, the pieces for each rank are packed side by side, and the result is cut back
apart. One exchange instead of three in forward, and one in backward (DeepSpeed's attention exchanges the
three apart). On 2 CPU ranks it measured even with three exchanges (attention forward and backward at sp 2:
269 / 264 ms at 4k tokens, 3.78 / 3.77 s at 16k: the packing copy costs what the saved waits gain); it is
meant for NCCL, where each collective has a fixed launch cost (to be measured on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_strategy.comm import Communicator

Group = Communicator | dist.ProcessGroup | None  # None: torch.distributed's default group


def group_size(group: Group) -> int:
    """The number of ranks of ``group`` (a Communicator, a torch ProcessGroup, or None for the world)."""
    if isinstance(group, Communicator):
        return group.world_size
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _exchange(x: torch.Tensor, group: Group, scatter_idx: int, gather_idx: int) -> torch.Tensor:
    p = group_size(group)
    n = x.shape[scatter_idx]
    if n % p:
        raise ValueError(
            f"seq_all_to_all: dim {scatter_idx} of a {tuple(x.shape)} tensor has {n} entries, not divisible "
            f"by the group size {p} (it must be a multiple of {p})"
        )
    # [n, rest...] -> [P, n/P, rest...], contiguous: piece j of dim 0 goes to rank j.
    front = x.movedim(scatter_idx, 0)
    send = front.reshape(p, n // p, *front.shape[1:]).contiguous()
    recv = torch.empty_like(send)
    if isinstance(group, Communicator):
        group.all_to_all_single(recv, send)
    else:
        dist.all_to_all_single(recv, send, group=group)
    # Where the gather dim sits in ``front`` (the scatter dim moved to 0 shifted the dims before it).
    g = gather_idx + 1 if gather_idx < scatter_idx else gather_idx
    # recv: [P, n/P, ...front dims 1..]; put P right before the gather dim and merge the two.
    merged = recv.movedim(0, g)  # the gather dim of ``front`` is now at g + 1, P at g
    shape = list(merged.shape)
    merged = merged.reshape(*shape[:g], shape[g] * shape[g + 1], *shape[g + 2 :])
    return merged.movedim(0, scatter_idx)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, scatter_idx: int, gather_idx: int) -> torch.Tensor:
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        return _exchange(x, group, scatter_idx, gather_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.group, ctx.gather_idx, ctx.scatter_idx), None, None, None


def seq_all_to_all(x: torch.Tensor, group: Group, scatter_idx: int, gather_idx: int) -> torch.Tensor:
    """Scatter dim ``scatter_idx`` of ``x`` over ``group`` and gather dim ``gather_idx`` (module notes);
    differentiable. ``x``'s scatter dim must be divisible by the group size, and every rank's ``x`` must
    have the same shape. A group of one returns ``x`` itself."""
    ndim = x.dim()
    s, g = scatter_idx % ndim, gather_idx % ndim
    if s == g:
        raise ValueError(f"seq_all_to_all: scatter_idx={scatter_idx} and gather_idx={gather_idx} name one dim")
    if group_size(group) == 1:
        return x
    out: torch.Tensor = _SeqAllToAll.apply(x, group, s, g)
    return out


def seq_all_to_all_many(
    xs: Sequence[torch.Tensor], group: Group, scatter_idx: int, gather_idx: int
) -> list[torch.Tensor]:
    """``[seq_all_to_all(x, group, scatter_idx, gather_idx) for x in xs]`` in one exchange (module notes).
    The tensors must match in every dim but the scatter dim and share a dtype; otherwise each goes alone."""
    p = group_size(group)
    if p == 1 or len(xs) < 2:
        return [seq_all_to_all(x, group, scatter_idx, gather_idx) for x in xs]
    ndim = xs[0].dim()
    s, g = scatter_idx % ndim, gather_idx % ndim
    rest = [tuple(d for i, d in enumerate(x.shape) if i != s) for x in xs]
    if any(r != rest[0] for r in rest) or any(x.dtype != xs[0].dtype or x.dim() != ndim for x in xs):
        return [seq_all_to_all(x, group, scatter_idx, gather_idx) for x in xs]
    for x in xs:
        if x.shape[s] % p:
            raise ValueError(
                f"seq_all_to_all: dim {s} of a {tuple(x.shape)} tensor has {x.shape[s]} entries, not divisible "
                f"by the group size {p} (it must be a multiple of {p})"
            )
    sizes = [x.shape[s] // p for x in xs]
    # [.., n_i, ..] -> [.., P, n_i/P, ..], packed along the n_i/P dims: piece j of every tensor side by side.
    packed = torch.cat([x.unflatten(s, (p, n)) for x, n in zip(xs, sizes, strict=True)], dim=s + 1)
    out = seq_all_to_all(packed, group, s, g + 1 if g > s else g)  # the P dim is scattered (1 left per rank)
    return list(out.squeeze(s).split(sizes, dim=s))
