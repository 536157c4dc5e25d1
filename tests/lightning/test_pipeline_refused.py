"""Issue 25, criterion 5: a LightningModule holding a PipelineModule gets one clear error naming the
supported path (initialize() + train_batch, launched with ds-launch), from the Trainer and Fabric faces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

pytestmark = pytest.mark.multiprocess


def _fit(rank: int, world: int, face: str) -> str:
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from ds_strategy.lightning import ZeroStrategy
    from ds_strategy.lightning.fabric_strategy import ZeroFabricStrategy
    from ds_strategy.pipe import LayerSpec, PipelineModule

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.pipe = PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1, loss_fn=nn.MSELoss())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.pipe(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Model()
    try:
        if face == "trainer":
            trainer = pl.Trainer(
                strategy=ZeroStrategy(stage=1),
                accelerator="cpu",
                devices=1,
                max_steps=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=2)
            trainer.fit(model, data)
        else:
            fabric = Fabric(strategy=ZeroFabricStrategy(stage=1), accelerator="cpu", devices=1)
            fabric.launch()
            fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("face", ["trainer", "fabric"])
def test_pipeline_module_in_lightning_names_the_supported_path(face: str) -> None:
    (msg,) = run_distributed(_fit, world_size=1, args=(face,), timeout=120)
    assert "Model.pipe is a ds_strategy.pipe.PipelineModule" in msg, msg
    assert "ds_strategy.initialize(model=pipeline_module" in msg and "ds-launch --num_procs N" in msg
