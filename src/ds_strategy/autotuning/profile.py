"""The profiling step at the start of a tune: what the model is, measured once, in one process.

Before any trial the tuner builds the model once (no engine, no collectives) and measures:

- its parameters (trainable and all), its repeated blocks (``units.repeated_blocks``: the entries of the
  largest list of structurally equal modules) and stage 3's largest fetch unit (a block, or the rest of the
  model when that is larger: ``runtime.memory.largest_fetch_unit``);
- the activation bytes one sample keeps alive for backward, without and with checkpointing every block
  ([Note: counting activations]);
- the forward flops of one sample (the flops profiler), for the ``flops`` metric and MFU.

[Note: counting activations]
A dispatch mode sees every tensor the forward makes. It keeps a weak reference to each new storage; after
the forward, the storages still alive are what autograd holds for backward (plus the output). Their bytes,
at micro batch 1 and 2, give the bytes per sample (the difference) apart from what does not grow with the
batch. This counts on any device (CPU included, where no allocator keeps statistics) and sees exactly what
checkpointing changes: under it a block keeps only its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ds_strategy.profiling.profiler import FlopsProfiler
from ds_strategy.runtime.activation_checkpointing.policy import apply_activation_checkpointing
from ds_strategy.runtime.memory import largest_fetch_unit
from ds_strategy.runtime.zero.units import repeated_blocks

from .data import BatchFn, LossFn, to_device


@dataclass(frozen=True)
class ModelProfile:
    """What the profiling step measured (see the module docstring)."""

    params: int  # trainable elements
    total_params: int
    blocks: int  # repeated blocks found (0: none; activation checkpointing is then not tuned)
    largest_unit: int  # trainable elements of stage 3's largest fetch unit (a block, or the rest when larger)
    activation_bytes_per_sample: int
    checkpointed_activation_bytes_per_sample: int  # every block checkpointed (= the above without blocks)
    forward_flops_per_sample: float

    @property
    def train_flops_per_sample(self) -> float:
        """Model flops of one sample's training step: forward and a backward of twice its cost."""
        return 3.0 * self.forward_flops_per_sample


class _Census(TorchDispatchMode):
    """Weak references to every storage an op creates (see [Note: counting activations])."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known = known  # data pointers of storages that existed before (parameters, the batch)
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.known and key not in self.made:
                    self.made[key] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        return sum(size for ref, size in self.made.values() if not ref.expired())


def _retained_bytes(model: nn.Module, batch: Any, loss_fn: LossFn) -> int:
    """Bytes the forward of ``batch`` leaves alive for backward (the loss graph held, then released)."""
    known = {p.untyped_storage().data_ptr() for p in model.parameters()}
    known |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    known |= {t.untyped_storage().data_ptr() for t in tree_leaves(batch) if isinstance(t, torch.Tensor)}
    census = _Census(known)
    with census:
        loss = loss_fn(model, batch)
    alive = census.alive_bytes()
    del loss  # the graph goes: nothing of this measurement outlives it
    return alive


def profile_model(
    model_fn: Callable[[], nn.Module],
    batch_fn: BatchFn,
    loss_fn: LossFn,
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float32,
    two_samples: bool = True,
) -> ModelProfile:
    """Build the model once on ``device`` in the run's compute ``dtype`` (whole: it must fit there) and measure
    it (see the module docstring). ``two_samples``: the per-rank batch allows a micro batch of 2 (else the
    bytes at micro batch 1 stand for one sample)."""
    model = model_fn().to(device, dtype)
    model.train()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    blocks = repeated_blocks(model)
    largest = largest_fetch_unit(model)

    def batch(micro: int) -> Any:
        return to_device(batch_fn(micro, 0), device, dtype)

    def per_sample(model: nn.Module) -> int:
        one = _retained_bytes(model, batch(1), loss_fn)
        if not two_samples:
            return one
        two = _retained_bytes(model, batch(2), loss_fn)
        return max(two - one, 0)

    plain = per_sample(model)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        loss_fn(model, batch(1))
    prof.stop_profile()
    flops = float(prof.get_total_flops())
    prof.end_profile()
    checkpointed = plain
    if blocks:
        checkpoint_blocks(model)
        checkpointed = per_sample(model)
    del model
    return ModelProfile(params, total, len(blocks), largest, plain, checkpointed, flops)


def checkpoint_blocks(model: nn.Module) -> list[str]:
    """Checkpoint every repeated block of ``model`` in place (the tuner's "activation checkpointing: per
    block"); returns the checkpointed modules' names (empty: the model has no repeated blocks)."""
    members = {id(b) for b in repeated_blocks(model)}
    if not members:
        return []
    return apply_activation_checkpointing(model, lambda m: id(m) in members)
