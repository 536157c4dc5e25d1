"""A ``peft`` LoRA fine-tune of a Hugging Face Llama at stage 3 on 2 ranks (issue 21, criterion 1).

The model is built from a tiny config under ``zero.Init`` (never downloaded), LoRA adapters are added by
``peft.get_peft_model``; the engine trains the adapters only. Each rank holds half of the frozen base (its
partition, padding aside) and optimizer state for its half of the adapters only; the losses and the trained
adapters equal a single-process torch AdamW run from the same weights on the global batch (fp32: the
tolerances of test_stage3.py). An adapters-only checkpoint (``exclude_frozen_parameters=True``) holds no
frozen weight and restores the adapters into a fresh engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, MICRO, SEQ, VOCAB, LR = 4, 2, 10, 96, 1e-2


def _base() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _lora(model: Any) -> Any:
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(model, cfg)


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000},
    }


def _data(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (MICRO * world, SEQ), generator=g) for _ in range(STEPS)]


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    from ds_strategy.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _reference(model: Any, data: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for ids in data:
        # The engine's loss is each rank's mean; their average is the global batch's mean (equal lengths).
        halves = [model(input_ids=h, labels=h).loss for h in ids.chunk(ids.shape[0] // MICRO)]
        loss = torch.stack(halves).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def _train(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    import ds_strategy

    torch.manual_seed(0)
    with ds_strategy.zero.Init():
        base = _base()
    model = _lora(base)
    full = _full_state(model)  # the reference starts from exactly these weights
    ref_model = _lora(_base())
    ref_model.load_state_dict(full)
    ref_losses, ref_weights = _reference(ref_model, _data(world))

    frozen_numel = sum(v.numel() for k, v in full.items() if "lora_" not in k)
    adapter_numel = sum(v.numel() for k, v in full.items() if "lora_" in k)
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=_config())
    stage = engine.stage
    losses = []
    for ids in _data(world):
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    weights = {k: v for k, v in _full_state(model).items() if "lora_" in k}
    memory = engine.memory_breakdown()
    at_rest_frozen = [p.numel() for p in model.parameters() if not p.requires_grad]
    engine.save_checkpoint(root, tag="adapters", exclude_frozen_parameters=True)
    engine.destroy()

    # A fresh model (other adapter initialisation) gets the adapters back from the adapters-only checkpoint.
    torch.manual_seed(1)
    with ds_strategy.zero.Init():
        base2 = _base()
    model2 = _lora(base2)
    with ds_strategy.zero.GatheredParameters([p for p in model2.parameters() if not p.requires_grad], modifier_rank=0):
        for k, p in model2.named_parameters():
            if not p.requires_grad:
                p.data.copy_(full[k])
    engine2, *_ = ds_strategy.initialize(model=model2, model_parameters=model2.parameters(), config=_config())
    engine2.load_checkpoint(root, tag="adapters")
    restored = {k: v for k, v in _full_state(model2).items() if "lora_" in k}
    engine2.destroy()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "weights": weights,
        "ref_weights": {k: v for k, v in ref_weights.items()},
        "restored": restored,
        "frozen_numel": frozen_numel,
        "adapter_numel": adapter_numel,
        "frozen_part": sum(gs.part.numel() for gs in stage.frozen),
        "memory": memory,
        "at_rest_frozen": at_rest_frozen,
    }


@pytest.mark.multiprocess
def test_peft_lora_at_stage3_holds_half_the_base_and_trains_like_torch(tmp_path: Path) -> None:
    results = run_distributed(_train, world_size=2, args=(str(tmp_path),), timeout=300)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=2e-6, atol=0)
        assert set(r["weights"]) == set(r["ref_weights"]) and r["weights"]
        for k, w in r["ref_weights"].items():
            torch.testing.assert_close(r["weights"][k], w, rtol=1e-5, atol=1e-6, msg=k)
            torch.testing.assert_close(r["restored"][k], r["weights"][k], rtol=0, atol=0, msg=f"restored {k}")
        # Half the frozen base per rank (each bucket's padding to a multiple of the world size aside) ...
        half = r["frozen_numel"] / 2
        assert half <= r["frozen_part"] <= half * 1.01, (r["frozen_part"], r["frozen_numel"])
        assert max(r["at_rest_frozen"]) == 0  # ... and no whole frozen parameter outside a gather
        # ... plus the adapters' share: fp32 masters and Adam's two moments for half the adapters each.
        mem = r["memory"]
        assert mem["optimizer_state"] <= 2 * 4 * r["adapter_numel"] / 2 * 1.05 + 64, mem
        assert mem["params"] <= 4 * (half + r["adapter_numel"]) * 1.02, mem
    # Both ranks trained the same adapters.
    for k, w in results[0]["weights"].items():
        torch.testing.assert_close(results[1]["weights"][k], w, rtol=0, atol=0)
