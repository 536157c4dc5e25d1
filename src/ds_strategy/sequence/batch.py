"""The batch adapter: one causal-LM batch, cut along the sequence for this rank of the sequence-parallel group.

Every rank of an SP group must receive the same batch (the P ranks hold one sequence between them): shard
the data over the data-parallel ranks only, e.g. ``DistributedSampler(ds, num_replicas=groups.dp_size,
rank=groups.dp_rank)``.

``shard_batch`` pads the sequence to a multiple of P at the end, builds the targets over the whole sequence
before cutting it (so the token after a shard boundary is still the target of the token before it), and
adds the normaliser that makes transformers' loss exact:

- ``ForCausalLMLoss`` returns ``sum(local CE) / num_items_in_batch``; with ``num_items_in_batch = T / P``
  (T: the valid targets of the whole sequence, summed over the SP group) each rank's loss is
  ``P * local_sum / T``. Its mean over the SP group is the token mean of the whole sequence, and since the
  engine averages gradients over all ``sp x dp`` ranks, the summed ``P * d(local_sum) / T`` over the group
  divided by P is the exact gradient of that mean.

The ``attention_mask`` is dropped: padding is only at the end and the attention is causal (module notes of
``ds_strategy.sequence.hf``). ``labels`` stays, as this rank's slice of the padded labels: transformers
computes a loss only when ``labels`` is passed, and ``ForCausalLMLoss`` uses ``shift_labels`` over it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ds_strategy.sequence.groups import SequenceGroups, active_groups

SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def resolve(groups: SequenceGroups | None, what: str) -> SequenceGroups:
    """``groups``, else the active layout; a clear error when there is neither."""
    found = groups if groups is not None else active_groups()
    if found is None:
        raise RuntimeError(
            f"{what}: no sequence-parallel layout: pass groups=SequenceGroups.build(...) or build the engine with "
            "sequence_parallel_size (it makes its layout the active one)"
        )
    return found


def shard_batch(
    batch: dict[str, Any],
    groups: SequenceGroups | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    *,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """This rank's shard of a causal-LM batch (module notes). A collective over the SP group when ``labels`` is
    present (the count of valid targets).

    ``batch``: ``input_ids`` ``[B, S]`` and optionally ``labels`` (``ignore_index`` where no loss is taken),
    ``position_ids`` (consecutive per row; packed rows are refused), ``attention_mask`` (ones then zeros per
    row; left or middle padding is refused). Other tensors of shape ``[B, S, ...]`` are padded with zeros and
    cut the same way; anything else is passed through. ``device``: move the tensors there first (the count
    is all-reduced where ``input_ids`` lives: give the compute device when the SP group is NCCL).

    Returns ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (``[B, S_pad / P]`` each),
    ``num_items_in_batch`` (a float32 scalar tensor), and the other entries.
    """
    layout = resolve(groups, "shard_batch")
    sp, rank = layout.sp_size, layout.sp_rank
    if device is not None:
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids must be [batch, sequence], got shape {tuple(ids.shape)}")
    b, s = ids.shape
    padded = -(-s // sp) * sp
    pad = padded - s
    chunk = padded // sp
    cut = slice(rank * chunk, (rank + 1) * chunk)

    mask = batch.get("attention_mask")
    if mask is not None:
        check_right_padded(mask, "shard_batch")
    positions = _positions(batch.get("position_ids"), b, s, pad, ids.device)

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS:
            continue
        if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (b, s):
            out[key] = _pad(value, pad, 0)[:, cut]
        else:
            out[key] = value
    out["input_ids"] = _pad(ids, pad, pad_token_id)[:, cut]
    out["position_ids"] = positions[:, cut]
    labels = batch.get("labels")
    if labels is not None:
        if tuple(labels.shape) != (b, s):
            raise ValueError(
                f"shard_batch: labels have shape {tuple(labels.shape)}, input_ids {(b, s)}; they must match"
            )
        full = _pad(labels, pad, ignore_index)
        # The target of position t is the label of t + 1, over the whole sequence; the last has none.
        shift = torch.cat([full[:, 1:], full.new_full((b, 1), ignore_index)], dim=1)
        out["labels"] = full[:, cut]
        out["shift_labels"] = shift[:, cut].contiguous()
        count = (out["shift_labels"] != ignore_index).sum().to(torch.float32)
        if layout.sp_comm is not None and sp > 1:
            layout.sp_comm.all_reduce(count)
        out["num_items_in_batch"] = count.clamp(min=1.0) / sp  # a row of pads only: loss 0, not 0/0
    return out


def _pad(x: torch.Tensor, pad: int, value: int) -> torch.Tensor:
    if pad == 0:
        return x
    fill = x.new_full((x.shape[0], pad, *x.shape[2:]), value)
    return torch.cat([x, fill], dim=1)


def _positions(positions: torch.Tensor | None, b: int, s: int, pad: int, device: torch.device) -> torch.Tensor:
    """``position_ids`` over the padded sequence: 0..S_pad-1, or the given ones continued through the pads."""
    if positions is None:
        return torch.arange(s + pad, device=device).unsqueeze(0).expand(b, -1)
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.shape[-1] != s or positions.shape[0] not in (1, b):
        raise ValueError(f"shard_batch: position_ids have shape {tuple(positions.shape)}, input_ids {(b, s)}")
    positions = positions.expand(b, -1)
    steps = positions[:, 1:] - positions[:, :-1]
    if bool((steps != 1).any()):
        row = int((steps != 1).any(dim=1).nonzero()[0])
        raise ValueError(
            f"shard_batch: position_ids of row {row} do not step by 1 (packed sequences, {int((steps[row] != 1).sum())}"
            " restarts): the causal attention of Ulysses would let each document see the ones before it; pack "
            "nothing, or one document per row"
        )
    if pad == 0:
        return positions
    more = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device, dtype=positions.dtype)
    return torch.cat([positions, more], dim=1)


def check_right_padded(mask: torch.Tensor, what: str) -> None:
    """Refuse a ``[B, S]`` mask with a zero before the last one of a row (a host sync)."""
    if mask.dim() != 2:
        raise ValueError(f"{what}: attention_mask must be [batch, sequence] (ones then zeros), got {tuple(mask.shape)}")
    real = mask != 0
    bad = real[:, 1:] & ~real[:, :-1]
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(
            f"{what}: attention_mask row {row} has padding before its last real token (left or middle padding, "
            f"{int((~real[row]).sum())} pads in {real.shape[1]} positions); Ulysses supports padding at the end only "
            "(causal attention keeps real tokens from the pads there): pad on the right"
        )


def shard_if_sequences(batch: Any) -> Any:
    """``shard_batch`` of a Hugging Face style batch (a mapping with ``input_ids``) over the active layout;
    any other batch as it is (what the Trainer and the autotuner's trials feed a sequence-parallel engine)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        return batch
    return shard_batch(dict(batch))


class ShardedSequenceLoader:
    """``shard_batch`` over every batch of ``loader`` (``groups=None``: the active layout at each batch);
    ``kw``: ``shard_batch``'s other arguments (``pad_token_id``, ``ignore_index``, ``device``)."""

    def __init__(self, loader: Iterable[dict[str, Any]], groups: SequenceGroups | None = None, **kw: Any) -> None:
        self.loader = loader
        self.groups = groups
        self.kw = kw

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield shard_batch(batch, self.groups, **self.kw)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
