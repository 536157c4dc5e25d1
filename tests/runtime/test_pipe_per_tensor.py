"""Per-tensor optimizers (Muon, Adafactor: ``zero_per_tensor``) on a PipelineModule: each stage's ZeRO-1
partitions whole matrices over its data-parallel group, and training matches one process running the same
optimizer over the same layers (the pipeline tests' tied model: the tied matrix is stepped once, its
gradient the sum of both stages' uses)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, reference_run, specs

STEPS, MICRO, GAS, LR = 3, 2, 2, 1e-2
OPTIMIZERS = {
    "Muon": {"lr": LR, "weight_decay": 0.0, "adam_lr": LR},
    "Adafactor": {"lr": LR},
}


def _train(rank: int, world: int, kind: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import PipelineModule
    from ds_strategy.utils import safe_get_full_fp32_param

    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    cfg = pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=0.0, stage=1)
    cfg["optimizer"] = {"type": kind, "params": OPTIMIZERS[kind]}
    engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
    d = module.topology().get_coord(rank).data
    losses = [float(engine.train_batch(iter(step[d]))) for step in data(STEPS, world // 2, GAS, MICRO)]
    weights = {n: safe_get_full_fp32_param(p).clone() for n, p in module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "weights": weights}


def _reference(kind: str) -> Any:
    if kind == "Muon":
        from ds_strategy import MuonWithAuxAdam

        return lambda ps: MuonWithAuxAdam(ps, **OPTIMIZERS[kind])
    return lambda ps: torch.optim.Adafactor(ps, **OPTIMIZERS[kind])


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4], ids=["pipe2", "pipe2xdata2"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_per_tensor_optimizer_on_a_pipeline_matches_one_process(kind: str, world: int) -> None:
    results = run_distributed(_train, world_size=world, args=(kind,), timeout=180)
    ref_losses, ref_weights = reference_run(
        data(STEPS, world // 2, GAS, MICRO), lr=LR, clip=0.0, optimizer=_reference(kind)
    )
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[name], rtol=1e-5, atol=1e-6, msg=name)
    assert set().union(*(r["weights"] for r in results)) == set(ref_weights)
