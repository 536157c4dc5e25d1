"""World size 8 on one GPU (issue 41, criterion 4): under torch's fake process group this process is rank 0
of 8 and runs the real stage-3 code of that rank (collectives launched, nothing moved). Checked here: the
steps after the first do no host synchronisation (``set_sync_debug_mode("error")``), and the peak memory
of the rank is ZeRO-3's: 16 bytes x parameters / 8 for the model states, plus the activations (measured
on the same GPU with the model unsharded), plus the units gathered at once (bf16), within 10%. Values
are not checked (nothing is exchanged); training equality is the rest of the suite's job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.cuda.common import ON_GPU, requires_gpu
from tests.fake_pg import fake_group

pytestmark = [requires_gpu, pytest.mark.skipif(not ON_GPU, reason="measures a real CUDA device")]

WORLD, STEPS, MICRO, SEQ = 8, 4, 4, 256
SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1408, "vocab_size": 8000}


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ, **SHAPE)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _batch() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (MICRO, SEQ), generator=torch.Generator().manual_seed(0)).cuda()


def _activation_bytes() -> int:
    """Peak of a bf16 forward + backward of the unsharded model, less its bf16 parameters and gradients."""
    model = _llama().to(device="cuda", dtype=torch.bfloat16)
    x = _batch()
    params = sum(p.numel() for p in model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model(input_ids=x, labels=x).loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model
    torch.cuda.empty_cache()
    return peak - 2 * params  # the gradients (bf16) appear during backward


@pytest.fixture
def rank_of_eight(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with fake_group(monkeypatch, world_size=WORLD):
        yield


def test_rank_of_eight_is_sync_free_and_holds_zero3_memory(rank_of_eight: None) -> None:
    import ds_strategy

    activations = _activation_bytes()
    model = _llama()
    params = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
    }
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert engine.coll.world_size == WORLD
    x = _batch()

    def step() -> None:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()

    step()  # records the order
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEPS - 1):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    gatherer = engine.stage.gatherer
    units = {tuple(keys) for keys in gatherer.units.values() if keys}
    largest = max(sum(engine.stage.storages[g].full[b].numel() for g, b in keys) for keys in units)
    states = 16 * params / WORLD
    working = 2 * 3 * largest  # bf16: the unit in use, the next one prefetched, the rest unit or a kept one
    bound = 1.1 * (states + activations + working)
    assert peak <= bound, (
        f"peak {peak / 2**20:.0f} MiB > 1.1 x (states {states / 2**20:.0f} + activations {activations / 2**20:.0f}"
        f" + gathered {working / 2**20:.0f}) MiB"
    )
    engine.destroy()
