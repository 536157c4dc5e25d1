"""World size 8 on one GPU (issue 41, criterion 4): under torch's fake process group this process is rank 0
of 8 and runs the real stage-3 code of that rank (collectives launched, nothing moved). Checked here: the
steps after the first do no host synchronisation (``set_sync_debug_mode("error")``), and the rank's peak
memory shows ZeRO-3's saving: against the same engine at world size 1 (everything whole), at least 80% of
the model-state bytes a rank of 8 stops holding (bf16 parameters, fp32 masters, gradients and Adam's two
moments: 18 bytes per parameter, 7/8 of them). Values are not checked (nothing is exchanged); training
equality is the rest of the suite's job."""

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


@pytest.fixture
def rank_of_eight(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with fake_group(monkeypatch, world_size=WORLD):
        yield


def _steps(step: Any, sync_free: bool) -> None:
    """STEPS steps: the first records the order, the others under ``set_sync_debug_mode("error")`` if
    ``sync_free`` (a host synchronisation raises)."""
    step()
    torch.cuda.synchronize()
    if sync_free:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEPS - 1):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _peak_of_steps(sync_free: bool) -> tuple[int, int]:
    """(peak allocated bytes over engine build and STEPS steps, parameter count) in the current group."""
    import ds_strategy

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
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = _batch()

    def step() -> None:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()

    _steps(step, sync_free)
    peak = torch.cuda.max_memory_allocated()
    engine.destroy()
    return peak, params


@pytest.fixture(scope="module")
def peak_at_world_one() -> int:
    """The same engine at world size 1 over NCCL (everything whole), gathering into bucket-sized tensors as a
    rank of 8 does (not in place: [Note: a group of one gathers in place]), so that both peaks hold the same
    working set and their difference is the model states. Module-scoped, as the suite's other process
    groups: NCCL's first start in the process is not a leak of the test that happens to run it."""
    from ds_strategy.runtime.zero.sharded import ShardedGroup
    from tests.cuda.common import destroy_process_group, init_single_process_group

    init_single_process_group()
    ShardedGroup.GATHER_IN_PLACE = False
    try:
        return _peak_of_steps(sync_free=False)[0]
    finally:
        ShardedGroup.GATHER_IN_PLACE = True
        destroy_process_group()


def test_rank_of_eight_is_sync_free_and_saves_zero3_memory(peak_at_world_one: int, rank_of_eight: None) -> None:
    peak8, params = _peak_of_steps(sync_free=True)
    theory = 18 * params * (WORLD - 1) / WORLD
    saved = peak_at_world_one - peak8
    assert saved >= 0.8 * theory, (
        f"world 8 peak {peak8 / 2**20:.0f} MiB, world 1 {peak_at_world_one / 2**20:.0f} MiB: saved "
        f"{saved / 2**20:.0f} MiB, < 80% of the {theory / 2**20:.0f} MiB of model states a rank of 8 stops holding"
    )


def test_rank_of_eight_tiles_a_frozen_head_without_synchronising(rank_of_eight: None) -> None:
    """A LoRA-style fine-tune (everything but the MLPs frozen) of a vocabulary-heavy Llama: the frozen
    embedding and head are tiled ([Note: tiled frozen weights] in runtime/zero/tiled.py), steps after the
    first make no host synchronisation, and the most gathered at once stays below the head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import ds_strategy

    torch.manual_seed(0)
    shape = {**SHAPE, "num_hidden_layers": 4, "vocab_size": 32000}
    cfg = LlamaConfig(num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ, **shape)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(".mlp." in name)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=config)
    gatherer = engine.stage.gatherer
    x = torch.randint(0, 32000, (MICRO, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    try:
        assert sorted(type(tw.module).__name__ for tw in gatherer.unit_map.tiled.values()) == ["Embedding", "Linear"]

        def step() -> None:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()

        _steps(step, sync_free=True)
        assert gatherer.peak_live < 32000 * shape["hidden_size"], gatherer.peak_live
    finally:
        engine.destroy()
