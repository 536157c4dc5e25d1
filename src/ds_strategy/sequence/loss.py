"""The cross entropy of a whole sequence split over the sequence-parallel group, for modules of our own.

``sequence_loss(x, targets)`` on each of the P ranks of an SP group (each holding ``S / P`` positions)
returns the token mean of the whole sequence, ``all_reduce_sum(local_sum) / T`` (T: the valid targets of
the whole sequence), the same value on every SP rank.

Gradient. The engine averages gradients over all ``sp x dp`` ranks, so for the exact gradient of the mean
over the data-parallel replicas each SP group's ranks must back-propagate, together, P times the gradient
of its sequence mean. The all-reduce's adjoint does exactly that: every rank's output depends on every
rank's ``local_sum``, so ``d local_sum_r`` receives the sum of the P incoming gradients (P x 1 / T).

Tiling. With ``head`` (``hidden -> logits``, e.g. the model's ``lm_head``) and ``chunk_size``, the logits
and the loss are computed ``chunk_size`` positions at a time, each chunk checkpointed (recomputed in
backward), so the ``[B, S/P, vocab]`` logits (and their float32 copy) never exist at once: at long
sequences the vocabulary projection is otherwise the largest activation of a language model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ds_strategy.comm import Communicator
from ds_strategy.sequence.groups import SequenceGroups, active_groups


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward; its adjoint (the same sum of the incoming gradients) in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        out = x.clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        ctx.comm.all_reduce(out)
        return out, None


def _ce_sum(
    x: torch.Tensor, targets: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None, ignore_index: int
) -> torch.Tensor:
    logits = x if head is None else head(x)
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


def sequence_loss(
    logits_or_hidden: torch.Tensor,
    labels: torch.Tensor,
    groups: SequenceGroups | None = None,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The token-mean cross entropy of the whole sequence (module notes); a collective over the SP group.

    ``logits_or_hidden``: ``[..., S/P, vocab]`` logits, or ``[..., S/P, hidden]`` when ``head`` is given.
    ``labels``: the target of each position, ``logits_or_hidden.shape[:-1]`` (already shifted: the
    ``shift_labels`` of ``shard_batch``). ``groups``: the layout (None: the active one; none active, or
    ``sp_size == 1``: the plain token mean of this rank). ``chunk_size``: positions per tile (None: one tile).
    """
    x = logits_or_hidden
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(
            f"sequence_loss: labels have shape {tuple(labels.shape)}, the {'hidden states' if head else 'logits'} "
            f"{tuple(x.shape)}; labels must be their shape without the last dim, {tuple(x.shape[:-1])}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"sequence_loss: chunk_size={chunk_size} must be a positive number of positions (or None)")
    seq_dim = x.dim() - 2
    length = x.shape[seq_dim] if x.dim() >= 2 else 1
    if chunk_size is None or chunk_size >= length:
        local = _ce_sum(x, labels, head, ignore_index)
    else:
        parts = []
        for start in range(0, length, chunk_size):
            n = min(chunk_size, length - start)
            part = checkpoint(
                _ce_sum,
                x.narrow(seq_dim, start, n),
                labels.narrow(seq_dim, start, n),
                head,
                ignore_index,
                use_reentrant=False,
                preserve_rng_state=False,  # no randomness in a projection and a cross entropy
            )
            parts.append(part)
        local = torch.stack(parts).sum()
    count = (labels != ignore_index).sum().to(torch.float32)
    layout = groups if groups is not None else active_groups()
    comm = None if layout is None or layout.sp_size == 1 else layout.sp_comm
    if comm is not None:
        comm.all_reduce(count)
        local = _AllReduceSum.apply(local, comm)
    return local / count.clamp(min=1.0)  # no valid target anywhere: 0, not 0/0
