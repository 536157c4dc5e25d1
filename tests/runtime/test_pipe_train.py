"""Pipeline training on 2 (pipe 2) and 4 (pipe 2 x data 2) processes equals one-process training.

The model (tests/runtime/pipe_common.py) ties a projection between stage 0 (first layer) and stage 1
(used transposed near the end), so the tie group's gradient sum and the global-norm clipping are both
exercised. Reference: the same layers in one process, the same per-layer seeds, the mean loss over every
micro-batch of every data-parallel rank, torch AdamW, clip_grad_norm_.

Tolerances (fp32): losses rtol 1e-5, weights atol 1e-6 - the pipeline sums per-micro-batch gradients
(scaled by 1/m) and averages over data-parallel ranks where the reference differentiates one mean, and
it steps the engine's AdamW: the same math, rounded in other places (observed differences ~1e-7).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, reference_run, specs

STEPS, MICRO, LR = 3, 2, 1e-2


def _train(rank: int, world: int, stages: int, gas: int, clip: float, precision: str, zero: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import PipelineEngine, PipelineModule

    dp = world // stages
    module = PipelineModule(specs(), num_stages=stages, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    cfg = pipe_config(micro=MICRO, gas=gas, lr=LR, clip=clip, stage=zero, **extra)
    engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
    assert isinstance(engine, PipelineEngine)
    d = module.topology().get_coord(rank).data
    batches = data(STEPS, dp, gas, MICRO)
    losses = []
    for step in batches:
        losses.append(float(engine.train_batch(iter(step[d]))))
    from ds_strategy.utils import safe_get_full_fp32_param

    weights = {n: safe_get_full_fp32_param(p).clone() for n, p in module.named_parameters()}
    return {
        "losses": losses,
        "weights": weights,
        "first": engine.is_first_stage(),
        "last": engine.is_last_stage(),
        "negotiations": engine.link.negotiations,
        "norm": engine.get_global_grad_norm(),
    }


@pytest.mark.parametrize(
    ("world", "gas", "clip", "zero"),
    [(2, 4, 0.0, 0), (2, 3, 0.05, 1), (4, 4, 0.05, 1)],
    ids=["pipe2-zero0", "pipe2-clip-zero1", "pipe2xdata2-clip-zero1"],
)
def test_pipeline_matches_one_process(world: int, gas: int, clip: float, zero: int) -> None:
    results = run_distributed(_train, world_size=world, args=(2, gas, clip, "fp32", zero), timeout=120)
    dp = world // 2
    ref_losses, ref_weights = reference_run(data(STEPS, dp, gas, MICRO), lr=LR, clip=clip)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        # one header per link direction: the activation link and the gradient link, never per micro-batch
        assert r["negotiations"] == 2
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-6, msg=name)
    # every parameter of the reference lives on some stage; the tied one on both, identical
    names = set().union(*(r["weights"] for r in results))
    assert names == set(ref_weights)
    tied = [r["weights"]["tied_modules.proj.weight"] for r in results]
    for t in tied[1:]:
        assert torch.equal(t, tied[0])
    if clip > 0:  # clipping was engaged: the global norm (every stage, tied weight once) exceeded it
        assert all(r["norm"] > clip for r in results)
        assert len({round(r["norm"], 9) for r in results}) == 1
