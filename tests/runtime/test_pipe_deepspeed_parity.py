"""Pipeline behaviours that DeepSpeed users rely on (a new-user scenario run against DeepSpeed 0.19.8 found
them): a resume with a warm-up schedule continues exactly (the param groups' lr is saved), a stage whose
layers are all frozen trains on the shared-memory transport, DeepSpeed's load_checkpoint keywords, and the
training_data loader read in order (DeepSpeed's pipeline sampler does not shuffle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, specs

MICRO, GAS = 2, 2


def _cases(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import LayerSpec, PipelineModule

    out: dict[str, Any] = {}
    batches = data(4, 1, GAS, MICRO)
    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}}
    cfg = pipe_config(micro=MICRO, gas=GAS, lr=0.01, clip=0.0, scheduler=warmup)

    def pipeline() -> Any:
        module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
        return ds_strategy.initialize(model=module, config=cfg)[0]

    def train(engine: Any, steps: list[Any]) -> list[float]:
        return [float(engine.train_batch(iter(step[0]))) for step in steps]

    engine = pipeline()
    train(engine, batches[:2])
    engine.save_checkpoint(root)
    out["uninterrupted"] = train(engine, batches[2:])
    engine.destroy()
    engine = pipeline()
    engine.load_checkpoint(root, load_module_strict=False, custom_load_fn=None)  # DeepSpeed's keywords
    out["resumed"] = train(engine, batches[2:])
    try:
        engine.save_checkpoint(root, exclude_frozen_parameters=True)
    except NotImplementedError as err:
        out["exclude"] = str(err)
    engine.destroy()

    # every parameter of stage 0 frozen: it sends back an empty list of input gradients
    torch.manual_seed(0)
    frozen = [LayerSpec(nn.Linear, 8, 8), nn.Tanh(), LayerSpec(nn.Linear, 8, 1)]
    module = PipelineModule(frozen, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    for p in module.parameters():
        if module.stage_id == 0:
            p.requires_grad_(False)
    plain = {k: v for k, v in pipe_config(micro=MICRO, gas=GAS, lr=0.01, clip=0.0).items() if k != "scheduler"}
    engine = ds_strategy.initialize(model=module, config=plain)[0]
    g = torch.Generator().manual_seed(3)
    steps = [[(torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 1, generator=g)) for _ in range(GAS)]]
    out["frozen_stage"] = [float(engine.train_batch(iter(s))) for s in steps * 2]
    engine.destroy()

    # training_data: micro-batches in dataset order, as DeepSpeed's pipeline engine reads them
    dataset = torch.utils.data.TensorDataset(torch.arange(16.0).unsqueeze(1), torch.zeros(16, 1))
    module = PipelineModule([LayerSpec(nn.Linear, 1, 1), LayerSpec(nn.Linear, 1, 1)], num_stages=2)
    engine, _, loader, _ = ds_strategy.initialize(model=module, config=plain, training_data=dataset)
    out["order"] = [b[0].flatten().tolist() for b in list(loader)[:2]]
    engine.destroy()
    return out


def test_pipeline_behaves_as_deepspeeds(tmp_path: Path) -> None:
    for rank, out in enumerate(run_distributed(_cases, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=300)):
        assert out["resumed"] == out["uninterrupted"], (rank, out)  # bit-exact: the saved lr, not WarmupLR's min
        assert "exclude_frozen_parameters=True): pipeline checkpoints hold every layer" in out["exclude"]
        assert len(out["frozen_stage"]) == 2 and all(map(lambda v: v == v, out["frozen_stage"]))
        assert out["order"] == [[0.0, 1.0], [2.0, 3.0]], out["order"]  # pipe 2 x data 1: this rank reads all
