"""``DistributedAttention``: DeepSpeed-Ulysses around any local attention (``deepspeed.sequence.layer``'s surface).

Each of the P ranks of the sequence-parallel group holds ``S / P`` tokens of the query, key and value
(by default laid out ``[S/P, batch, heads, head_dim]``). An all-to-all trades the sequence shard for a head
shard (every rank sees the whole sequence for ``heads / P`` heads), the wrapped attention runs on that, and
a second all-to-all trades back. Attention is computed per head, so the result is the single-process
attention of the whole sequence, cut along the sequence.

Grouped-query attention: the key / value heads are replicated before the exchange when needed, so that the
heads a rank receives are exactly the ones its query heads read (DeepSpeed replicates key / value heads
fewer than P ``P / kv`` times; the general factor here is ``P / gcd(kv, P)``, the same for those cases).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_strategy.sequence.all_to_all import Group, group_size, seq_all_to_all, seq_all_to_all_many
from ds_strategy.sequence.groups import active_groups


def check_heads(query_heads: int, kv_heads: int, sp: int) -> int:
    """The replication factor of the key / value heads for ``sp`` ranks (1: none); a ValueError naming the
    numbers when the query heads cannot be split over ``sp`` ranks."""
    if query_heads % sp:
        valid = [d for d in range(1, query_heads + 1) if query_heads % d == 0]
        raise ValueError(
            f"Ulysses sequence parallelism splits the {query_heads} query heads over the {sp} ranks of the "
            f"sequence-parallel group: {query_heads} is not divisible by {sp} (valid sequence_parallel_size "
            f"for {query_heads} heads: {valid})"
        )
    if kv_heads < 1 or query_heads % kv_heads:
        raise ValueError(
            f"{query_heads} query heads cannot share {kv_heads} key/value heads (grouped-query attention needs "
            "the query heads to be a multiple of the key/value heads)"
        )
    return sp // math.gcd(kv_heads, sp)


def replicate_kv(x: torch.Tensor, factor: int, head_dim: int) -> torch.Tensor:
    """Each key / value head ``factor`` times in a row along ``head_dim`` (query head i of H reads kv head
    ``i // (H / kv)``, and so still reads its own copy after the split over ranks)."""
    return x if factor == 1 else x.repeat_interleave(factor, dim=head_dim)


class DistributedAttention(nn.Module):
    """DeepSpeed's ``DistributedAttention(local_attention, sequence_process_group, scatter_idx=2, gather_idx=0)``.

    ``local_attention(query, key, value, *args, **kwargs)``: any callable taking the whole sequence for a
    slice of the heads in the same layout as the inputs. ``sequence_process_group``: a ``Communicator`` or
    torch ProcessGroup of the SP ranks; None reads the active layout (``active_groups()``) at every call, and
    with none active the attention runs unsharded. ``scatter_idx``: the head dim of the inputs;
    ``gather_idx``: their sequence dim (defaults: ``[S/P, batch, heads, head_dim]``).
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor],
        sequence_process_group: Group = None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx

    def _group(self) -> Group:
        if self.spg is not None:
            return self.spg
        groups = active_groups()
        return None if groups is None else groups.sp_comm

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The attention of the whole sequence, for this rank's shard of it (the inputs' layout).

        DeepSpeed's current signature ``forward(query, key, value, batch_dim_idx, *args, **kwargs)`` is
        accepted too: an ``int`` right after ``value`` (or ``batch_dim_idx=``) is taken as the batch dim
        (0: ``[batch, S/P, heads, dim]``, 1: ``[S/P, batch, heads, dim]``), sets the sequence dim to the
        other of dims 0 and 1, and is not passed to the local attention.
        """
        gather = self.gather_idx
        batch_dim = kwargs.pop("batch_dim_idx", None)
        if batch_dim is None and args and isinstance(args[0], int) and not isinstance(args[0], bool):
            batch_dim, args = args[0], args[1:]
        if batch_dim is not None:
            if batch_dim not in (0, 1):
                raise ValueError(f"batch_dim_idx={batch_dim}: DeepSpeed's layouts put the batch at dim 0 or 1")
            gather = 1 - batch_dim
        group = self._group()
        if not _has_peers(group):  # one rank holds the whole sequence
            return self.local_attn(query, key, value, *args, **kwargs)
        heads = self.scatter_idx % query.dim()
        factor = check_heads(query.shape[heads], key.shape[heads], group_size(group))
        key = replicate_kv(key, factor, heads)
        value = replicate_kv(value, factor, heads)
        q, k, v = seq_all_to_all_many((query, key, value), group, heads, gather)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, group, gather, heads)


def _has_peers(group: Group) -> bool:
    if group is None:  # DeepSpeed's None means the world; here it means "no active layout"
        return False
    return group_size(group) > 1
