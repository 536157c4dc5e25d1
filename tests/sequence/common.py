"""Helpers shared by the sequence-parallel tests: the layout a body builds, and its slice of a sequence."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ds_strategy.sequence import SequenceGroups, set_active


@contextmanager
def layout(sp: int, active: bool = True) -> Iterator[SequenceGroups]:
    """``SequenceGroups.build(sp)`` (made active unless told not to), closed afterwards."""
    groups = SequenceGroups.build(sp)
    if active:
        set_active(groups)
    try:
        yield groups
    finally:
        groups.close()
        set_active(None)


def shard(x: torch.Tensor, groups: SequenceGroups, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (the sequence)."""
    n = x.shape[dim] // groups.sp_size
    return x.narrow(dim, groups.sp_rank * n, n)


def tiny_causal_lm(kind: str, attn: str, **extra: object):  # type: ignore[no-untyped-def]
    """A tiny ``<kind>ForCausalLM`` from a config (4 query heads, 2 key/value heads unless ``extra`` says
    otherwise; seed 0, so the same on every rank and in every run), in fp32, training mode."""
    import transformers

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 64,
    }
    config = getattr(transformers, f"{kind}Config")(**{"num_key_value_heads": 2, **common, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")._from_config(config, attn_implementation=attn)
    return model.float().train()
