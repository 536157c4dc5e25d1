"""What a trial feeds the model: batches of any micro-batch size from what the user gave, and the loss.

``data`` may be a callable ``batch(micro_batch_size, step) -> batch`` (full control), a map-style dataset
(``__len__`` and ``__getitem__``: samples are collated with torch's ``default_collate``), or one tensor
(its rows are the samples). Each rank reads its own samples: step ``s`` of rank ``r`` with micro batch ``m``
takes the ``m`` samples from index ``(s x world + r) x m`` on, wrapping around the dataset, so every trial
sees the same data in the same order whatever its micro batch.

The default loss is what a model's forward returns: a scalar tensor, or the ``loss`` of a Hugging Face
output (a mapping batch is passed as keyword arguments, a tuple as positional ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

BatchFn = Callable[[int, int], Any]  # (micro batch size, step) -> one rank's batch
LossFn = Callable[[Any, Any], torch.Tensor]  # (model or engine, batch) -> loss


def batch_fn_of(data: Any, rank: int, world_size: int) -> BatchFn:
    """``data`` as a ``(micro_batch_size, step) -> batch`` function for ``rank`` (see the module docstring)."""
    if callable(data) and not isinstance(data, torch.Tensor) and not hasattr(data, "__getitem__"):
        return data
    if isinstance(data, torch.Tensor):
        if data.dim() == 0 or len(data) == 0:
            raise ValueError(
                f"autotune data: a tensor of samples needs at least one row, got shape {tuple(data.shape)}"
            )
        rows = data

        def from_tensor(micro: int, step: int) -> Any:
            return rows[_indices(len(rows), micro, step, rank, world_size)]

        return from_tensor
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        size = len(data)
        if size == 0:
            raise ValueError("autotune data: the dataset is empty")

        def from_dataset(micro: int, step: int) -> Any:
            return default_collate([data[int(i)] for i in _indices(size, micro, step, rank, world_size)])

        return from_dataset
    raise TypeError(
        "autotune data: expected a callable (micro_batch_size, step) -> batch, a map-style dataset or a tensor "
        f"of samples, got {type(data).__name__}"
    )


def _indices(size: int, micro: int, step: int, rank: int, world_size: int) -> torch.Tensor:
    start = (step * world_size + rank) * micro
    return torch.arange(start, start + micro) % size


def default_loss(model: Callable[..., Any], batch: Any) -> torch.Tensor:
    """The loss a forward returns (see the module docstring); a clear error when it returns something else."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    if isinstance(loss, (tuple, list)) and loss:
        loss = loss[0]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            "autotune: the model's forward did not return a scalar loss (nor an output with .loss); pass "
            "loss_fn=lambda model, batch: ... that computes it"
        )
    return loss


def to_device(batch: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``batch`` (a tensor, or mappings / lists / tuples of them) on ``device``, its floating tensors in
    ``dtype`` when given (as the engine casts inputs to the compute dtype); other values as they are."""
    if isinstance(batch, torch.Tensor):
        cast = dtype if dtype is not None and batch.is_floating_point() else None
        return batch.to(device, cast, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, dtype) for v in batch)
    return batch
