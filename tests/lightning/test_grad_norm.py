"""Lightning's ``grad_norm`` idiom under every ZeroStrategy stage (issue 21, criterion 4).

A callback's ``on_before_optimizer_step`` reads ``lightning.pytorch.utilities.grad_norm(pl_module, 2)``
(per-parameter 2-norms of ``p.grad`` and their total) and a LightningModule overriding the same hook
reads the parameters' ``.grad`` directly. Under ZeroStrategy the engine keeps the reduced gradients in its
own buffers; for the hook they are shown as ``p.grad``: averaged over the ranks and unscaled, as DDP has
them. The norms equal DDP's at every step (fp32, rtol 1e-5: the same tolerance as the parity tests of
test_trainer.py) at stages 0-3 with accumulation, offload included, and ``p.grad`` is None again after
the hook.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, fit_run

pytestmark = pytest.mark.multiprocess


class GradNorms(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[dict[str, float]] = []
        self.after: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.norms.append({k: float(v) for k, v in grad_norm(pl_module, norm_type=2).items()})
        shapes = [
            tuple(p.grad.shape) == tuple(s) for p, s in zip(pl_module.parameters(), _shapes(pl_module), strict=True)
        ]
        assert all(shapes), "p.grad has the parameter's true shape"

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append(sum(p.grad is not None for p in trainer.lightning_module.parameters()))

    def state_dict(self) -> dict[str, Any]:
        return {"norms": self.norms, "after": self.after}


def _shapes(module: pl.LightningModule) -> list[torch.Size]:
    from ds_strategy.runtime.zero.init import init_shard

    out = []
    for p in module.parameters():
        slot = getattr(p, "_ds_zero3", None)
        if slot is not None:  # stage 3: the placeholder's true shape comes from the layout
            stage, g, i = slot
            out.append(stage.groups[g].layout.params[i].shape)
        else:
            info = init_shard(p)
            out.append(p.shape if info is None else info.shape)
    return out


def _norms(strategy: Any) -> list[dict[str, Any]]:
    trainer = {"accumulate_grad_batches": 2, "max_epochs": 1, "callbacks": [GradNorms()]}
    runs = run_distributed(
        fit_run, 2, args=(strategy, trainer, {"optimizer": "sgd", "lr": 0.1}), env=ELASTIC_ENV, init_process_group=False
    )
    return [r["callbacks"]["GradNorms"] for r in runs]


@pytest.fixture(scope="module")
def ddp() -> list[dict[str, Any]]:
    return _norms("ddp")


@pytest.mark.parametrize(
    "name", ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_sharded", "zero3_offload"]
)
def test_grad_norm_in_on_before_optimizer_step_equals_ddp(name: str, ddp: list[dict[str, Any]]) -> None:
    for got, ref in zip(_norms(name), ddp, strict=True):
        assert len(got["norms"]) == len(ref["norms"]) == 4  # 8 micro-batches per rank, accumulation 2
        for step, (g, r) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
            assert g.keys() == r.keys() and len(r) == 5, (g, r)  # 4 parameters and the total
            for k, v in r.items():
                assert g[k] == pytest.approx(v, rel=1e-5), (name, step, k)
        assert got["after"] and not any(got["after"])  # the gradients were shown for the hook only
