"""Hugging Face's own ``gradient_checkpointing_enable()`` under every ZeRO stage (issue 20, criterion 2).

A tiny Llama built from a config (never downloaded) trains 3 steps on 2 ranks with and without gradient
checkpointing, reentrant and not; the losses and weights must match the run without it (fp32; the reentrant
form sums a parameter's gradients across segments in the stage, not in autograd: 1e-5 relative).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")

STEPS = 3


def _model() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _train(rank: int, world: int, stage: int) -> dict[str, Any]:
    import ds_strategy

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 64, (2 * world, 12), generator=g) for _ in range(STEPS)]
    out: dict[str, Any] = {}
    for mode in ("none", "reentrant", "non_reentrant"):
        model = _model()
        if mode != "none":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000},
        }
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.train()
        losses = []
        for ids in data:
            mine = ids[rank * 2 : (rank + 1) * 2]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        from ds_strategy.zero import GatheredParameters

        with GatheredParameters(list(model.parameters())):
            weights = {k: v.detach().clone() for k, v in model.named_parameters()}
        engine.destroy()
        out[mode] = {"losses": losses, "weights": weights}
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_checkpointing_enable_trains_like_without(stage: int) -> None:
    for r in run_distributed(_train, world_size=2, args=(stage,), timeout=300):
        base = r["none"]
        for mode in ("reentrant", "non_reentrant"):
            got = r[mode]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"]), rtol=1e-5, atol=0)
            for name, w in base["weights"].items():
                torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")
