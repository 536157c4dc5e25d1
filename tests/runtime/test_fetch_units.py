"""Stage 3's fetch units ([Note: fetch units] in runtime/zero/units.py): blocks by default, per-module units
on request, policies; training equals the single process either way; collectives per step are bounded by
the number of blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import causal_lm_reference

WORLD, STEPS, MICRO, LAYERS, VOCAB, SEQ = 2, 3, 2, 4, 64, 8


def _llama(layers: int = LAYERS) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        intermediate_size=64,
        vocab_size=VOCAB,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


class Head2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


# ---------------------------------------------------------------------- which modules are units
def test_default_units_are_the_repeated_blocks_and_the_rest_is_one_more() -> None:
    from ds_strategy.runtime.zero.units import BLOCKS, repeated_blocks, unit_owners

    model = _llama()
    assert repeated_blocks(model) == list(model.model.layers)
    owners = unit_owners(model, BLOCKS)
    for layer in model.model.layers:
        assert all(owners[id(m)] is layer for m in layer.modules())
    for rest in (model.model.embed_tokens, model.model.norm, model.lm_head):
        assert owners[id(rest)] is model


def test_encoder_decoder_lists_are_both_blocks_and_a_model_without_repeats_keeps_module_units() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    from ds_strategy.runtime.zero.units import BLOCKS, repeated_blocks, unit_owners

    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=2)
    )
    assert repeated_blocks(t5) == list(t5.encoder.block) + list(t5.decoder.block)
    plain = Head2()
    assert repeated_blocks(plain) == []
    assert all(unit_owners(plain, BLOCKS)[id(m)] is m for m in plain.modules())
    # parameterless repeats are not blocks
    assert repeated_blocks(nn.Sequential(nn.ReLU(), nn.ReLU())) == []


def test_policies_classes_names_callables_and_leaves() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    from ds_strategy.runtime.zero.leaf import set_z3_leaf_modules
    from ds_strategy.runtime.zero.units import MODULES, unit_owners

    model = _llama()
    by_class = unit_owners(model, {LlamaMLP})
    by_name = unit_owners(model, ("LlamaMLP",))
    by_call = unit_owners(model, lambda m: isinstance(m, LlamaMLP))
    for layer in model.model.layers:
        for owners in (by_class, by_name, by_call):
            assert all(owners[id(m)] is layer.mlp for m in layer.mlp.modules())
            assert owners[id(layer.self_attn.q_proj)] is model  # not selected: the rest
    per_module = unit_owners(model, MODULES)
    assert all(per_module[id(m)] is m for m in model.modules())
    set_z3_leaf_modules(model, ["LlamaAttention"])  # a leaf is a unit under every policy
    per_module = unit_owners(model, MODULES)
    attn = model.model.layers[0].self_attn
    assert per_module[id(attn.q_proj)] is attn
    assert unit_owners(model, {LlamaMLP})[id(attn.k_proj)] is attn


def test_bad_policies_name_where_they_came_from() -> None:
    from ds_strategy.runtime.zero.units import set_fetch_units

    with pytest.raises(ValueError, match="set_fetch_units: fetch-unit policy 'layers' is not valid"):
        set_fetch_units(nn.Linear(2, 2), "layers")
    with pytest.raises(TypeError, match="set_fetch_units"):
        set_fetch_units(nn.Linear(2, 2), [3])


def test_the_config_key_is_validated_with_its_name() -> None:
    from ds_strategy.config import load_config

    with pytest.raises(Exception, match="stage3_fetch_units"):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "stage3_fetch_units": 7}})


# ---------------------------------------------------------------------- training and collectives
def _train(rank: int, world: int, units: Any, precision: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.runtime.zero.units import set_fetch_units

    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=gen) for _ in range(STEPS)]
    out: dict[str, Any] = {}
    ref = _llama()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    out["reference"] = []
    for batch in data:
        loss = ref(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out["reference"].append(loss.item())
    model = _llama()
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 40}
    if isinstance(units, str):
        zero["stage3_fetch_units"] = units
    else:
        set_fetch_units(model, units)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "comms_logger": {"enabled": True},
        precision: {"enabled": True},
    }
    if precision == "fp32":
        del cfg["fp32"]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, counts = [], []
    for batch in data:
        engine.comms_logger.reset()
        mine = batch[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        counts.append({s.op: s.count for s in engine.comms_logger.summary()})
    out.update(losses=losses, counts=counts, buckets=[len(gs.full) for gs in engine.stage.storages])
    engine.destroy()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("units", ["blocks", "modules", "classes"])
def test_stage3_units_train_like_the_single_process_with_bounded_collectives(units: str) -> None:
    policy: Any = ("LlamaDecoderLayer",) if units == "classes" else units
    for r in run_distributed(_train, world_size=WORLD, args=(policy, "fp32"), timeout=240):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=2e-5, atol=2e-6)
        for counts in r["counts"][1:]:  # after the first step, which records the order
            gathers, reductions = counts.get("all_gather", 0), counts.get("reduce_scatter", 0)
            if units == "modules":  # one unit per Linear / embedding: many more of both
                assert gathers > 2 * LAYERS + 4 and reductions > LAYERS + 2, counts
            else:
                assert 0 < gathers <= 2 * LAYERS + 4 and 0 < reductions <= LAYERS + 2, counts


@pytest.mark.multiprocess
def test_stage3_block_units_in_bf16_match_module_units() -> None:
    blocks = run_distributed(_train, world_size=WORLD, args=("blocks", "bf16"), timeout=240)
    modules = run_distributed(_train, world_size=WORLD, args=("modules", "bf16"), timeout=240)
    for b, m in zip(blocks, modules, strict=True):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(m["losses"]), rtol=0, atol=0)


def test_external_parameter_registered_after_the_build_hooks_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with no unit carries no hooks; registering an external parameter on it after the engine was
    built gives it a unit, and hooks with it (rank 0 of a fake group of 2: shapes, not values)."""
    import ds_strategy
    from ds_strategy.zero import register_external_parameter
    from tests.fake_pg import fake_group

    class Scorer(nn.Module):  # no parameters of its own: reads the embedding's weight
        def forward(self, h: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
            return h @ weight.t()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 16)
            self.mix = nn.Linear(16, 16)
            self.scorer = Scorer()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scorer(self.mix(self.embed(x)), self.embed.weight).square().mean()

    with fake_group(monkeypatch, world_size=2):
        torch.manual_seed(0)
        model = Net()
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        gatherer = engine.stage.gatherer
        hooked = lambda m: bool(m._forward_pre_hooks)  # noqa: E731
        assert not gatherer.units[id(model.scorer)] and not hooked(model.scorer)
        register_external_parameter(model.scorer, model.embed.weight)
        assert gatherer.units[id(model.scorer)] and hooked(model.scorer)
        x = torch.randint(0, VOCAB, (2, SEQ))
        for _ in range(2):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
        engine.destroy()


# ------------------------------------------------------------------ a large frozen rest (see units.py)
def _wide_llama(vocab: int = 1024) -> nn.Module:
    """Vocabulary-heavy: the embedding and head (32 x 1024 each) are over 6x a block (10k parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32, num_hidden_layers=LAYERS, intermediate_size=64, vocab_size=vocab, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _freeze_all_but_mlps(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(".mlp." in name)


def test_a_large_frozen_rest_is_split_into_its_modules_and_a_trained_one_stays_whole() -> None:
    from ds_strategy.runtime.zero.units import BLOCKS, unit_owners

    model = _wide_llama()
    rest = (model.model.embed_tokens, model.model.norm, model.lm_head)
    owners = unit_owners(model, BLOCKS)
    assert all(owners[id(m)] is model for m in rest)  # trained: one unit, one reduce-scatter
    _freeze_all_but_mlps(model)
    owners = unit_owners(model, BLOCKS)
    assert all(owners[id(m)] is m for m in rest)  # frozen, 6x a block: each gathered for its own use
    for layer in model.model.layers:
        assert all(owners[id(m)] is layer for m in layer.modules())
    # Sizes come from ``numel`` (a built engine's parameters are partitions or placeholders): all equal, no split.
    owners = unit_owners(model, BLOCKS, numel=lambda p: 1)
    assert all(owners[id(m)] is model for m in rest)
    small = _wide_llama(vocab=64)  # the rest is below twice a block: stays one unit though frozen
    _freeze_all_but_mlps(small)
    owners = unit_owners(small, BLOCKS)
    assert owners[id(small.lm_head)] is small


def _train_frozen_rest(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    vocab = 1024
    gen = torch.Generator().manual_seed(7)
    data = [torch.randint(0, vocab, (MICRO * world, SEQ), generator=gen) for _ in range(STEPS)]
    ref = _wide_llama(vocab)
    _freeze_all_but_mlps(ref)
    reference = causal_lm_reference(ref, data)
    model = _wide_llama(vocab)
    _freeze_all_but_mlps(model)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        # the split itself (untiled: a tiled embedding and head have no unit, test_tiled_frozen.py)
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40, "stage3_tile_frozen": False},
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=cfg)
    gatherer = engine.stage.gatherer
    embed = gatherer.units[id(model.model.embed_tokens)]
    live_at_head: list[bool] = []
    hook = model.lm_head.register_forward_pre_hook(
        lambda m, a: live_at_head.append(any(gatherer.live(k) for k in embed))
    )
    losses = []
    for batch in data:
        mine = batch[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    hook.remove()
    out = {
        "losses": losses,
        "reference": reference,
        "embed_unit_is_its_own": embed and embed != gatherer.units[id(model.lm_head)],
        "live_at_head": live_at_head,
    }
    engine.destroy()
    return out


@pytest.mark.multiprocess
def test_a_split_frozen_rest_trains_like_the_single_process_and_frees_the_embedding_before_the_head() -> None:
    for r in run_distributed(_train_frozen_rest, world_size=WORLD, timeout=240):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=2e-5, atol=2e-6)
        assert r["embed_unit_is_its_own"]
        assert r["live_at_head"] == [False] * STEPS, r["live_at_head"]  # freed after the embedding ran
