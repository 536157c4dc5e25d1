"""Ulysses for Hugging Face models: an attention function registered with transformers' ``AttentionInterface``.

    import transformers
    from ds_strategy.sequence import register
    register()                                   # "ds_ulysses", core "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ds_ulysses")

Every model whose attention calls ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen2 and most decoders of
transformers 5) then runs unchanged on a sequence shard: transformers hands the function this rank's
``[B, H, S/P, D]`` query and ``[B, Hkv, S/P, D]`` key / value (rotary embeddings already applied with the
shard's global ``position_ids``, from the batch adapter); the function trades the sequence shard for a head
shard, runs causal attention over the whole sequence, trades back and returns ``[B, S/P, H, D]``.

Masks. For a name missing from transformers' ``AttentionMaskInterface``, ``create_causal_mask`` does not
pass the model's 2-D ``attention_mask`` on: it returns None (only a 4-D mask is passed through as it is),
so a padding mask would be dropped silently. ``register`` therefore also registers a mask function under
the same name. It builds no mask (transformers would build the local shard's ``S/P x S/P`` square, which
means nothing after the exchange): it gathers a 2-D ``attention_mask`` over the SP group, refuses one with a
zero before the last real token of a row (left or middle padding), and returns None. It runs once per
forward (a host sync; ``shard_batch`` drops the mask, so normally there is nothing to check). Causality is
the core's ``is_causal`` over the whole sequence, and padding at the end (where ``shard_batch`` puts it) is
then never seen by a real token. A 4-D mask reaching the attention is refused; so is a sliding window
shorter than the sequence (Mistral's ``sliding_window``: the causal core attends to all earlier tokens).
Packed sequences (several documents in one row) are refused by ``shard_batch``: the causal core would let
a document see the ones before it.

Keyword arguments: whatever the caller passes to the model's forward (``position_ids``, and the batch's
``shift_labels`` and ``num_items_in_batch``) flows down to every attention call in ``**kwargs``; the
``"sdpa"`` core ignores them.

transformers is never imported here: ``register`` takes it from ``sys.modules`` (the caller imported it),
so ``ds_strategy.sequence`` stays importable, and cheap, without it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ds_strategy.sequence.all_to_all import seq_all_to_all, seq_all_to_all_many
from ds_strategy.sequence.attention import check_heads, replicate_kv
from ds_strategy.sequence.batch import check_right_padded
from ds_strategy.sequence.groups import active_groups

NAME = "ds_ulysses"


def _transformers() -> Any:
    module = sys.modules.get("transformers")
    if module is None:
        raise RuntimeError(
            "ds_strategy.sequence.register: transformers is not imported; `import transformers` (or build the model) "
            "before registering the Ulysses attention"
        )
    return module


def register(name: str = NAME, core: str = "sdpa") -> Callable[..., tuple[torch.Tensor, None]]:
    """Register the Ulysses attention with transformers under ``name`` and return the function.

    ``core``: the attention run on the whole sequence for this rank's heads. ``"sdpa"``: torch's
    ``scaled_dot_product_attention`` with ``is_causal=True`` (grouped-query attention through
    ``enable_gqa``). ``"flash_attention_2"`` (``_3``, ``_4``): transformers' flash attention, called as
    transformers calls it, with no mask and ``is_causal=True``. Other cores are refused: transformers' eager
    and flex attention are causal only through a mask, which does not exist for the whole sequence here.
    """
    transformers = _transformers()
    interface = transformers.AttentionInterface
    flash = sorted(k for k in interface._global_mapping if k.startswith("flash_attention_"))
    if core != "sdpa" and core not in flash:
        raise ValueError(
            f"register(core={core!r}): Ulysses runs 'sdpa' or transformers' flash attention ({', '.join(flash)}) "
            "over the whole sequence; eager and flex attention are causal only through a mask it cannot pass"
        )
    if name in interface._global_mapping and not getattr(interface._global_mapping[name], "_ds_ulysses", False):
        raise ValueError(f"register(name={name!r}): transformers already has an attention of that name; pick another")

    def ulysses_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return _forward(core, module, query, key, value, attention_mask, scaling, dropout, kwargs)

    ulysses_attention._ds_ulysses = True  # type: ignore[attr-defined]  # ours: registering again replaces it
    ulysses_attention.__name__ = f"{name}_{core}"
    interface.register(name, ulysses_attention)
    masks = importlib.import_module("transformers.masking_utils").AttentionMaskInterface
    masks.register(name, _check_padding_mask)  # without it transformers drops a 2-D mask (module notes)
    return ulysses_attention


def _check_padding_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """The mask function registered with the attention: checks the padding (module notes), builds no mask."""
    if attention_mask is not None:
        groups = active_groups()
        _check_mask(attention_mask, None if groups is None else groups.sp_comm)


def _forward(
    core: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    groups = active_groups()
    comm = None if groups is None else groups.sp_comm
    sp = 1 if comm is None else comm.world_size
    if attention_mask is not None:
        _check_mask(attention_mask, comm)
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"Ulysses attention: {query.shape[2]} queries against {key.shape[2]} keys per rank (a key/value cache: "
            "generation) is not supported; it needs the same shard of the sequence for both (training, evaluation)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and query.shape[2] * sp > window:
        raise ValueError(
            f"Ulysses attention: a sliding window of {window} tokens over a sequence of {query.shape[2] * sp} "
            f"({query.shape[2]} per rank x {sp}) is not supported (the core is causal over the whole sequence); "
            f"use sequences of at most {window} tokens or a model without sliding-window layers"
        )
    factor = check_heads(query.shape[1], key.shape[1], sp)
    if sp > 1:  # [B, H, S/P, D] -> [B, H/P, S, D]
        key, value = replicate_kv(key, factor, 1), replicate_kv(value, factor, 1)
        query, key, value = seq_all_to_all_many((query, key, value), comm, 1, 2)
    if core == "sdpa":
        gqa = key.shape[1] != query.shape[1]
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )
    else:
        drop = ("position_ids", "is_causal", "sliding_window")  # the shard's positions; causal is ours
        kwargs = {k: v for k, v in kwargs.items() if k not in drop}
        fn = _transformers().AttentionInterface._global_mapping[core]
        local = _LocalHeads(module, query.shape[1] // key.shape[1])
        out, _ = fn(local, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
        out = out.transpose(1, 2)  # transformers' cores return [B, S, H, D]
    if sp > 1:  # [B, H/P, S, D] -> [B, H, S/P, D]
        out = seq_all_to_all(out, comm, 2, 1)
    return out.transpose(1, 2).contiguous(), None


class _LocalHeads:
    """The attention module as a transformers core sees it after the exchange: the same attributes, but
    ``num_key_value_groups`` of the local heads (key / value heads may have been replicated). A view: the
    module itself is not changed."""

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _check_mask(mask: torch.Tensor, comm: Any) -> None:
    """Refuse a mask Ulysses cannot honour (module notes); a host sync."""
    if mask.dim() != 2:
        raise ValueError(
            f"Ulysses attention got a {mask.dim()}-D attention_mask of shape {tuple(mask.shape)}: only padding at the "
            "end of each row is supported, through causal attention; pass no attention_mask (shard_batch drops it)"
        )
    full = (mask != 0).to(torch.int32)  # every backend gathers int32 (not all take bool)
    if comm is not None and comm.world_size > 1:
        parts = full.new_empty((comm.world_size, *mask.shape))
        comm.all_gather_into_tensor(parts, full.contiguous())
        full = parts.permute(1, 0, 2).reshape(mask.shape[0], -1)
    check_right_padded(full, "Ulysses attention")
