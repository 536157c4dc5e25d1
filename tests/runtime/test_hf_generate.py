"""``generate()`` of a Hugging Face model under stage 3 on 2 ranks (issue 21, criterion 5).

Each rank generates a different number of tokens (its own prompt and ``max_new_tokens``); with
``synced_gpus=True`` the rank that finishes first keeps running forward passes until every rank is done, so
the ranks' parameter gathers stay in step (without it that rank stops gathering and its peer would wait on
it). The tokens equal single-process greedy generation with the whole model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import llama_prompt, tiny_llama

transformers = pytest.importorskip("transformers")


def _generate(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    model = tiny_llama()
    expected = [model.generate(llama_prompt(r), max_new_tokens=3 + 4 * r, do_sample=False) for r in range(world)]
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.eval()
    with torch.no_grad():
        got = engine.module.generate(llama_prompt(rank), max_new_tokens=3 + 4 * rank, do_sample=False, synced_gpus=True)
    at_rest = max(p.numel() for p in model.parameters())
    engine.destroy()
    return {"got": got, "expected": expected[rank], "at_rest": at_rest}


@pytest.mark.multiprocess
def test_generate_at_stage3_with_synced_gpus_equals_single_process() -> None:
    for rank, r in enumerate(run_distributed(_generate, world_size=2, timeout=300)):
        assert r["at_rest"] == 0  # the weights really were partitioned
        assert r["got"].shape[1] == 5 + rank + 3 + 4 * rank
        torch.testing.assert_close(r["got"], r["expected"], rtol=0, atol=0)
