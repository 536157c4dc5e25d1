"""The profiling step: parameters, blocks, activation bytes per sample (against autograd's own saved
tensors) and what checkpointing every block saves (issue 44, criterion 3)."""

from __future__ import annotations

import torch
from torch import nn

from ds_strategy.autotuning import checkpoint_blocks
from ds_strategy.autotuning.data import batch_fn_of, default_loss
from ds_strategy.autotuning.profile import profile_model
from ds_strategy.runtime.memory import saved_activation_bytes
from tests.autotuning.models import Net


def _saved_bytes(model: nn.Module, batch: torch.Tensor) -> int:
    """Autograd's view: unique storages saved for backward, parameters left out (the input counted)."""
    return saved_activation_bytes(model, lambda: model(batch))


def test_the_profile_counts_parameters_blocks_and_activation_bytes_per_sample() -> None:
    torch.manual_seed(0)
    data = torch.randn(64, 32)
    batch = batch_fn_of(data, 0, 1)
    prof = profile_model(lambda: Net(32, 4), batch, default_loss, torch.device("cpu"))
    model = Net(32, 4)
    assert prof.params == prof.total_params == sum(p.numel() for p in model.parameters())
    assert prof.blocks == 4 and prof.largest_unit == sum(p.numel() for p in model.blocks[0].parameters())
    # (the rest - the head - is smaller than a block)
    want = _saved_bytes(model, data[:2]) - _saved_bytes(model, data[:1]) - 32 * 4  # the census leaves the input out
    # What the census sees beyond autograd's saved tensors: the loss and its few scalars, not per sample.
    assert abs(prof.activation_bytes_per_sample - want) <= 0.05 * want, (prof.activation_bytes_per_sample, want)
    # Checkpointing every block keeps only each block's input: 32 floats per block and sample.
    assert prof.checkpointed_activation_bytes_per_sample < prof.activation_bytes_per_sample / 4
    assert prof.checkpointed_activation_bytes_per_sample >= 4 * 32 * 4 - 1
    # Forward flops: two linear layers of 32x128 per block and the head, 2 flops per multiply-add.
    assert prof.forward_flops_per_sample == 4 * 2 * 2 * 32 * 128 + 2 * 32


def test_checkpoint_blocks_checkpoints_the_repeated_blocks_only() -> None:
    model = Net(32, 4)
    names = checkpoint_blocks(model)
    assert names == [f"blocks.{i}" for i in range(4)]
    assert checkpoint_blocks(nn.Linear(2, 2)) == []
    x = torch.randn(3, 32, requires_grad=True)
    model(x).backward()  # recomputation runs
    assert x.grad is not None
