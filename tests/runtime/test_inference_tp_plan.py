"""Tensor-parallel generation's plan against a model (runtime/inference_tp.py), in one process: where plans
come from, which layers they split, and what is refused before any rank generates."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from ds_strategy.demo.model import GPT, GPTConfig
from ds_strategy.runtime.inference_tp import TensorParallelPlanError, plan_splits, tp_plan


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def _llama(heads: int = 2) -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_plans_come_from_the_model_its_hugging_face_config_or_its_submodules() -> None:
    assert tp_plan(_gpt()) == GPT.tp_plan
    llama = tp_plan(_llama())
    assert llama["model.layers.*.self_attn.q_proj"] == "colwise"  # base_model_tp_plan, prefixed
    assert llama["model.layers.*.mlp.down_proj"] == "rowwise"
    wrapper = nn.Module()
    wrapper.net = _gpt()
    assert tp_plan(wrapper) == {f"net.{k}": v for k, v in GPT.tp_plan.items()}
    assert tp_plan(nn.Sequential(nn.Linear(2, 2))) == {}


def test_the_plan_names_each_split_layer_once() -> None:
    splits = plan_splits(_gpt(), GPT.tp_plan, 2)
    assert [(s.name, s.style) for s in splits[:4]] == [
        ("blocks.0.attn", "packed_qkv_colwise"),
        ("blocks.0.attn.out_proj", "rowwise"),
        ("blocks.0.mlp.0", "colwise"),
        ("blocks.0.mlp.2", "rowwise"),
    ]
    assert len(splits) == 8
    llama = _llama()
    names = [s.name for s in plan_splits(llama, tp_plan(llama), 2)]
    assert len(names) == 14 and "model.embed_tokens" not in names  # embedding_rowwise stays whole


@pytest.mark.parametrize(
    ("model", "plan", "size", "message"),
    [
        (lambda: _llama(heads=3), None, 2, "num_attention_heads is 3"),
        (lambda: _gpt(), {"blocks.*.mlp.0": "colwise"}, 3, r"'blocks.0.mlp.0' \(colwise\) has 128 output features"),
        (lambda: _gpt(), {"blocks.*.ln1": "colwise"}, 2, "is a LayerNorm; only nn.Linear"),
        (lambda: _gpt(), {"blocks.*.mlp.0": "grouped_gemm"}, 2, r"uses \['grouped_gemm'\]"),
        (lambda: _gpt(), {"decoder.*.fc": "colwise"}, 2, "names no module of the model"),
    ],
)
def test_what_does_not_split_is_refused_with_the_reason(model: Any, plan: Any, size: int, message: str) -> None:
    module = model()
    with pytest.raises(TensorParallelPlanError, match=message):
        plan_splits(module, plan if plan is not None else tp_plan(module), size)


def test_heads_are_checked_inside_a_wrapper_too() -> None:
    wrapper = nn.Module()
    wrapper.model = _llama(heads=3)
    with pytest.raises(TensorParallelPlanError, match="num_attention_heads is 3"):
        plan_splits(wrapper, tp_plan(wrapper), 2)
