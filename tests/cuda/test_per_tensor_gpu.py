"""Per-tensor optimizers on one GPU (issue 46): ``MuonWithAuxAdam`` and ``torch.optim.Adafactor`` at stages 1-3
train tests/runtime/test_per_tensor_optimizers.py's small language model like the same torch optimizer on the
same GPU (fp32, 4 steps of 2 micro-steps). At world size 1 every parameter is this rank's; what this proves is
the CUDA path of the whole-parameter tensors: shaped views of masters on the device, their gradients bound
before the step, Muon's Newton-Schulz on the GPU, the publish (and stage 3's gather) of what they wrote.
Tolerance: the 2-rank CPU test's (losses rtol 1e-5, weights atol 2e-5); cuBLAS may pick other kernels for
the engine's views than for the reference's tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.cuda.common import destroy_process_group, device, init_single_process_group, requires_gpu
from tests.runtime.test_per_tensor_optimizers import (
    GAS,
    LOSS_RTOL,
    STEPS,
    WEIGHT_ATOL,
    _config,
    _data,
    _model,
    _optimizer,
    _slice,
)

pytestmark = [requires_gpu]


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    init_single_process_group()
    yield
    destroy_process_group()


def _reference(kind: str, dev: torch.device) -> dict[str, Any]:
    model = _model().to(dev)
    opt = _optimizer(kind, model)
    assert opt is not None
    losses = []
    for batch in _data(1)[:STEPS]:
        loss = model(*(t.to(dev) for t in batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_per_tensor_optimizer_trains_like_torch_on_the_gpu(kind: str, stage: int) -> None:
    import ds_strategy
    from ds_strategy.zero import GatheredParameters

    dev = device()
    model = _model().to(dev)
    engine, *_ = ds_strategy.initialize(
        model=model, optimizer=_optimizer(kind, model), config=_config(stage, kind, 4096)
    )
    try:
        assert engine.stage.whole is not None
        assert all(t.device == dev for ts in engine.stage.whole.params for t in ts)
        losses = []
        for batch in _data(1)[:STEPS]:
            total = 0.0
            for m in range(GAS):
                loss = engine(*(t.to(dev) for t in _slice(batch, 1, m, 0)))
                engine.backward(loss)
                engine.step()
                total += loss.item()
            losses.append(total / GAS)
        with GatheredParameters(list(engine.module.parameters())):
            got = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    finally:
        engine.destroy()
    ref = _reference(kind, dev)
    assert losses == pytest.approx(ref["losses"], rel=LOSS_RTOL), (kind, stage)
    for name, value in ref["params"].items():
        assert (got[name] - value).abs().max().item() <= WEIGHT_ATOL, (kind, stage, name)
