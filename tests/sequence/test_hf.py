"""Hugging Face models with ``attn_implementation="ds_ulysses"`` on 2 gloo ranks against one process.

Each rank builds the same tiny model from a config (same seed), the reference runs it with
``attn_implementation="sdpa"`` on the whole batch, and the Ulysses copy runs this rank's ``shard_batch``
slice; gradients are averaged over the two ranks as the engine does. The sequence (13) is not a multiple
of 2 (padding), one row is right-padded with an ``attention_mask`` (dropped by ``shard_batch``), labels
have ignored positions. Expected: the mean of the ranks' losses equals the reference loss and the averaged
gradients equal the reference gradients, fp32, atol 1e-5 / rtol 1e-4 (the same arithmetic in another
order: the attention runs per head, the loss sums per shard).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.sequence.common import layout, tiny_causal_lm

TOL = {"atol": 1e-5, "rtol": 1e-4}


_model = tiny_causal_lm


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 10:] = 0  # row 1: 3 pads at the end
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, 2:5] = -100  # ignored targets, all in the first shard
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def fake_flash(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):  # type: ignore[no-untyped-def]
    """A stand-in for transformers' flash attention (not on CPU): its calling convention, GQA through
    ``module.num_key_value_groups`` (as transformers' cores without native GQA do), ``[B, S, H, D]`` out."""
    import torch.nn.functional as F

    assert attention_mask is None and is_causal is True and "position_ids" not in kwargs
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def _parity_body(rank: int, world: int, kind: str, core: str, kv: int) -> None:
    import transformers

    from ds_strategy.sequence import register, shard_batch

    name = "ds_ulysses" if core == "sdpa" else "ds_ulysses_fake"
    if core != "sdpa":
        transformers.AttentionInterface.register(core, fake_flash)
    register(name, core=core)
    batch = _batch()
    ref = _model(kind, "sdpa", num_key_value_heads=kv)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    with layout(world) as groups:
        model = _model(kind, name, num_key_value_heads=kv)
        local = shard_batch(batch, pad_token_id=0)
        assert local["input_ids"].shape == (2, 7) and "attention_mask" not in local
        loss = model(**local).loss
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        torch.testing.assert_close(mean_loss / world, ref_loss.detach(), **TOL)
        for (name_, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None, name_
            grad = p.grad.clone()
            dist.all_reduce(grad)  # the engine's average over the sp x dp ranks
            torch.testing.assert_close(grad / world, q.grad, **TOL, msg=lambda m, n=name_: f"{n}: {m}")
        assert groups.sp_size == world
        # the modules were viewed, not changed: their own number of key/value groups is the model's
        assert all(layer.self_attn.num_key_value_groups == 4 // kv for layer in model.model.layers)
    if core != "sdpa":  # leave the worker's transformers as it was
        from transformers.masking_utils import AttentionMaskInterface

        for interface in (transformers.AttentionInterface, AttentionMaskInterface):
            interface._global_mapping.pop(name, None)
        transformers.AttentionInterface._global_mapping.pop(core)


@pytest.mark.parametrize(
    ("kind", "core", "kv"),
    [
        ("Llama", "sdpa", 2),
        ("Qwen2", "sdpa", 2),
        ("Mistral", "sdpa", 2),  # its default sliding window (4096) covers the sequence
        ("Llama", "flash_attention_fake", 1),  # 1 kv head replicated to 2: the core sees 2 query heads per kv head
    ],
)
def test_matches_one_process(kind: str, core: str, kv: int) -> None:
    run_distributed(_parity_body, world_size=2, args=(kind, core, kv))


def _refusals_body(rank: int, world: int) -> list[str]:
    import transformers  # noqa: F401  (register takes it from sys.modules)

    from ds_strategy.sequence import register, shard_batch

    register()
    errors = []
    batch = _batch()
    with layout(world):
        model = _model("Llama", "ds_ulysses")
        left = batch["attention_mask"].flip(1)  # left padding: zeros before the real tokens
        for call in (
            lambda: shard_batch({**batch, "attention_mask": left}),
            lambda: shard_batch({**batch, "position_ids": torch.cat([torch.arange(6), torch.arange(7)])}),
            # a mask that reaches the attention function is gathered over the group and checked
            lambda: model(
                input_ids=batch["input_ids"][:, :7], attention_mask=left[:, :7] if rank == 0 else left[:, 6:]
            ),
            lambda: register(core="flex_attention"),
            lambda: _model("Mistral", "ds_ulysses", sliding_window=8)(**shard_batch(batch)),
            lambda: model.generate(shard_batch(batch)["input_ids"], max_new_tokens=2, do_sample=False),
        ):
            try:
                call()
            except ValueError as err:
                errors.append(str(err))
            else:
                errors.append("no error")
    return errors


def test_refusals_name_the_problem() -> None:
    errors = run_distributed(_refusals_body, world_size=2)[0]
    assert (
        "attention_mask row 1 has padding before its last real token (left or middle padding, 3 pads in 13" in errors[0]
    ), errors[0]
    assert "position_ids of row 0 do not step by 1" in errors[1], errors[1]
    assert "Ulysses attention: attention_mask row 1 has padding before its last real token" in errors[2], errors[2]
    assert "register(core='flex_attention'): Ulysses runs 'sdpa' or transformers' flash" in errors[3], errors[3]
    assert "sliding window of 8 tokens over a sequence of 14 (7 per rank x 2)" in errors[4], errors[4]
    assert "1 queries against 8 keys per rank (a key/value cache: generation) is not supported" in errors[5], errors[5]


def test_register_needs_transformers_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ds_strategy.sequence import register

    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    with pytest.raises(RuntimeError, match="transformers is not imported"):
        register()
