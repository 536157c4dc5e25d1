"""Stage 1 raises in its first forward: under ds-launch both processes must exit (non-zero), none hang."""

import torch
import torch.distributed as dist
from torch import nn

import ds_strategy
from ds_strategy.pipe import LayerSpec, PipelineModule


class Boom(nn.Module):
    def forward(self, x):
        if dist.get_rank() == 1:
            raise ValueError("boom")
        return x


model = PipelineModule(
    [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4), Boom()],
    num_stages=2,
    loss_fn=nn.MSELoss(),
    partition_method="uniform",
)
cfg = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 1},
}
engine, _, _, _ = ds_strategy.initialize(model=model, config=cfg)
engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4))] * 2))
