"""The pipeline engine under the device-strict mode (``DS_STRATEGY_DEVICE_STRICT=1``, see [Note: device-strict
mode] in ds_strategy/accelerator/strict.py): every collective and point-to-point message of the pipeline
(activations, gradients, link headers, the tied-weight sum and broadcast, the cross-stage norm, the loss
aggregation, the failure agreement) and of its checkpoints carries device memory, as NCCL requires.

Two grids: 2 stages (2 processes) and 2 stages x 2 data-parallel ranks (4 processes), with ZeRO-1, gradient
clipping and a tied weight, through torch.distributed (``DS_STRATEGY_SHM=0``: no shared-memory channels,
which the strict mode also switches off). Results are compared with the single-process torch reference
(tests/runtime/pipe_common.py); the checkpoint saved under the mode is loaded at the other grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, reference_run, specs

pytestmark = [pytest.mark.multiprocess]

STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}
NO_SHM = {"DS_STRATEGY_SHM": "0"}
STEPS, MICRO, GAS, LR, CLIP = 3, 2, 3, 1e-2, 0.05


def _train(rank: int, world: int, root: str, load_from: str | None) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.accelerator import strict
    from ds_strategy.pipe import PipelineModule
    from ds_strategy.utils import safe_get_full_fp32_param

    assert strict.ACTIVE
    dp = world // 2
    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    engine, _, _, _ = ds_strategy.initialize(model=module, config=pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=CLIP))
    dev = engine.device
    assert dev == torch.device("cpu", 0), dev
    d = module.topology().get_coord(rank).data
    batches = data(STEPS, dp, GAS, MICRO)
    out: dict[str, Any] = {}
    if load_from is not None:
        engine.load_checkpoint(load_from)
        batches = batches[engine.global_steps :]
    losses = []
    for step in batches:
        micro = [(x.to(dev), y.to(dev)) for x, y in step[d]]
        losses.append(float(engine.train_batch(iter(micro))))
    out["losses"] = losses
    out["eval"] = float(engine.eval_batch(iter([(x.to(dev), y.to(dev)) for x, y in data(1, dp, GAS, MICRO)[0][d]])))
    out["weights"] = {n: safe_get_full_fp32_param(p).cpu().clone() for n, p in module.named_parameters()}
    engine.save_checkpoint(root)
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4], ids=["pipe2", "pipe2xdata2"])
def test_pipeline_trains_and_checkpoints_under_the_strict_mode(tmp_path: Path, world: int) -> None:
    results = run_distributed(
        _train, world_size=world, args=(str(tmp_path), None), env=NO_SHM, process_env=STRICT, timeout=240
    )
    ref_losses, ref_weights = reference_run(data(STEPS, world // 2, GAS, MICRO), lr=LR, clip=CLIP)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-6, msg=name)
