"""Hugging Face weights in and out of partitions on 2 ranks (issue 21, criterion 3).

A tiny Llama (tied and untied head) is saved by transformers itself, sharded with an index. Each rank then:

1. builds the model under ``zero.Init`` and ``load_hf_weights`` it (each rank reads its slices), builds a
   stage-3 engine and compares the logits with the single-process model loaded by ``from_pretrained``;
2. loads the files straight into engines at stages 0, 2 and 3 (stage 3 with a frozen part, bf16 at
   stage 2), same comparison;
3. trains 2 steps at stage 3, exports with ``save_hf_weights`` (sharded; fp32 and the bf16 default) and
   ``ds-zero-to-fp32 --safetensors``; ``AutoModelForCausalLM.from_pretrained`` of each export holds the
   engine's weights (fp32: exactly; bf16: their bf16 rounding), keys and sharding as Hugging Face's own;
4. gets a CheckpointError naming the keys for a model that does not match, and loads with ``prefix=``.

Logits compare at rtol 1e-5 / atol 1e-6 (the engine's forward is the same arithmetic on the same weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOL = {"rtol": 1e-5, "atol": 1e-6}
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def _config(tied: bool) -> Any:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )


def _engine_config(stage: int, bf16: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000},
        "bf16": {"enabled": bf16},
    }


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _body(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.runtime.checkpoint import CheckpointError
    from ds_strategy.runtime.checkpoint.consolidate import main as zero_to_fp32
    from ds_strategy.utils import load_hf_weights, safe_get_full_fp32_param, save_hf_weights

    out: dict[str, Any] = {}
    for tied in (False, True):
        base = f"{root}/base-{int(tied)}"
        expected = _logits(transformers.AutoModelForCausalLM.from_pretrained(base))
        # 1. zero.Init + load_hf_weights, then a stage-3 engine.
        torch.manual_seed(rank + 10)  # other random weights on each rank: the file must win
        with ds_strategy.zero.Init():
            model = transformers.LlamaForCausalLM(_config(tied))
        load_hf_weights(model, base)
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=_engine_config(3))
        out[f"init-{tied}"] = (_logits(engine), expected)
        engine.destroy()
        # 2. straight into engines.
        for stage, bf16, freeze in ((0, False, False), (2, True, False), (3, False, True)):
            torch.manual_seed(rank + 20)
            model = transformers.LlamaForCausalLM(_config(tied))
            if freeze:
                model.model.layers[0].requires_grad_(False)
            params = [p for p in model.parameters() if p.requires_grad]
            engine, *_ = ds_strategy.initialize(
                model=model, model_parameters=params, config=_engine_config(stage, bf16)
            )
            load_hf_weights(engine, base)
            ref = transformers.AutoModelForCausalLM.from_pretrained(base)
            if bf16:  # the engine computes with bf16 weights (rounded from the fp32 masters it loaded)
                ref = ref.to(torch.bfloat16)
            out[f"engine-{stage}-{tied}"] = (_logits(engine), _logits(ref))
            engine.destroy()
    # 3. export after training, from a stage-3 engine (tied and untied covered above; untied here).
    torch.manual_seed(0)
    with ds_strategy.zero.Init():
        model = transformers.LlamaForCausalLM(_config(False))
    load_hf_weights(model, f"{root}/base-0")
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=_engine_config(3))
    for _ in range(2):
        loss = engine(input_ids=IDS[rank : rank + 1], labels=IDS[rank : rank + 1]).loss
        engine.backward(loss)
        engine.step()
    trained = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    save_hf_weights(engine, f"{root}/out32", dtype=torch.float32, max_shard_size="30KB")
    save_hf_weights(model, f"{root}/out16", max_shard_size="30KB")  # the module works as well as the engine
    engine.save_checkpoint(f"{root}/ckpt", tag="t")
    if rank == 0:
        for d in ("out32", "out16", "fp32"):
            model.config.save_pretrained(f"{root}/{d}")
        assert zero_to_fp32([f"{root}/ckpt", f"{root}/fp32", "--safetensors", "--max-shard-size", "30KB"]) == 0
        out["exports"] = {
            d: {
                k: v.detach().clone()
                for k, v in transformers.AutoModelForCausalLM.from_pretrained(f"{root}/{d}").named_parameters()
            }
            for d in ("out32", "out16", "fp32")
        }
        out["trained"] = trained
    engine.destroy()
    # 4. strict keys and prefix.
    holder = torch.nn.Module()
    holder.model = transformers.LlamaForCausalLM(_config(False))
    try:
        load_hf_weights(holder, f"{root}/base-0")
    except CheckpointError as err:
        out["strict_error"] = str(err)
    load_hf_weights(holder, f"{root}/base-0", prefix="model.")
    out["prefixed"] = _logits(holder.model)
    return out


@pytest.mark.multiprocess
def test_hf_weights_in_and_out_of_partitions(tmp_path: Path) -> None:
    for tied in (False, True):
        torch.manual_seed(1)
        transformers.LlamaForCausalLM(_config(tied)).save_pretrained(
            tmp_path / f"base-{int(tied)}", max_shard_size="30KB"
        )
        assert (tmp_path / f"base-{int(tied)}" / "model.safetensors.index.json").is_file()  # really sharded
    results = run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout=300)
    for r in results:
        compared = [k for k in r if k.startswith(("init-", "engine-"))]
        assert len(compared) == 8, compared
        for key in compared:
            got, expected = r[key]
            torch.testing.assert_close(got, expected, **TOL, msg=key)
        assert "missing keys ['model.lm_head.weight', 'model.model.embed_tokens.weight'" in r["strict_error"]
        assert "unexpected keys ['lm_head.weight'" in r["strict_error"]
        torch.testing.assert_close(r["prefixed"], results[0]["init-False"][1], **TOL)
    exports, trained = results[0]["exports"], results[0]["trained"]
    for d in ("out32", "out16", "fp32"):
        index = json.loads((tmp_path / d / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(trained) and index["metadata"]["total_size"] > 0, d
        assert len(set(index["weight_map"].values())) > 1, d  # sharded at 30KB
        for name, value in trained.items():
            # fp32 training: the default-dtype export (out16) is fp32 too, so every export is exact.
            torch.testing.assert_close(exports[d][name], value, rtol=0, atol=0, msg=f"{d} {name}")
