"""Two processes on one GPU, CUDA tensors through gloo: every collective the engine issues crosses a real
backend, which world size 1 never does.

NCCL refuses two ranks on one GPU, gloo does not: it takes CUDA tensors for all_reduce, broadcast and
all_gather (staging them through host memory), not for reduce_scatter. The engine's facade issues gloo's
reduce_scatter and all_gather as all_reduce (see [Note: gloo reduce_scatter and all_gather through
all_reduce] in ds_strategy/comm/collectives.py), so every stage runs here; the comms logger confirms that
the gradient reduction and the parameter gathers went through gloo. Each rank computes the single-process
torch reference on the GPU itself; the tolerances are ``TOLERANCES`` of tests/cuda/common.py (rtol 1e-5 in fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.cuda.common import (
    PROCESS_ENV,
    assert_trains_like,
    device,
    engine_run,
    full_masters,
    on_device,
    placement_errors,
    reference_on_device,
    requires_gpu,
)
from tests.harness import run_distributed
from tests.runtime.common import batches, config, groups_of, make_model

pytestmark = [requires_gpu, pytest.mark.multiprocess, pytest.mark.kernels]

WORLD, STEPS, MICRO, GAS, LR = 2, 4, 2, 2, 1e-2
# CUDA tensors go to gloo, never to the shared-memory path (which takes host tensors only): a rehearsal
# on CPU switches that path off to take the same route.
NO_SHM = {"DS_STRATEGY_SHM": "0"}
CASES = [  # (stage, precision, offload_optimizer, offload_param)
    (0, "fp32", False, False),
    (1, "fp32", False, False),
    (2, "fp32", False, False),
    (2, "fp32", True, False),
    (3, "fp32", False, False),
    (3, "fp32", True, True),
    (3, "fp16", False, False),
]


def run(fn: Any, *args: Any) -> list[Any]:
    return run_distributed(fn, world_size=WORLD, args=args, env=NO_SHM, process_env=PROCESS_ENV, timeout=300)


def _train(rank: int, world: int, stage: int, precision: str, offload: bool, offload_param: bool) -> dict[str, Any]:
    import ds_strategy

    assert dist.get_backend() == "gloo"
    data = batches(STEPS, MICRO * GAS * world)
    model = make_model()
    cfg = config(stage=stage, precision=precision, offload=offload, micro=MICRO, gas=GAS, lr=LR, clip=0.5)
    cfg["comms_logger"] = {"enabled": True}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu" if offload_param else "none", "pin_memory": True}
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    assert engine.device == device(), engine.device
    got = engine_run(engine, data, micro=MICRO, gas=GAS)
    got["placement"] = placement_errors(engine, offload_optimizer=offload, offload_param=offload_param, pin_memory=True)
    got["logged"] = sorted({(s.op, s.path) for s in engine.comms_logger.summary()})
    got["reference"] = reference_on_device(
        data,
        precision=precision,
        micro=MICRO,
        world=world,
        gas=GAS,
        lr=LR,
        clip=0.5,
        loss_scale=2.0**8 if precision == "fp16" else 1.0,
    )
    engine.destroy()
    return got


@pytest.mark.parametrize(
    ("stage", "precision", "offload", "offload_param"),
    CASES,
    ids=[f"stage{s}-{p}{'-offload' if o else ''}{'-param' if q else ''}" for s, p, o, q in CASES],
)
def test_stage_trains_like_torch_with_cuda_tensors_over_gloo(
    stage: int, precision: str, offload: bool, offload_param: bool
) -> None:
    ranks = run(_train, stage, precision, offload, offload_param)
    for rank, got in enumerate(ranks):
        ref, label = got["reference"], f"rank {rank} stage {stage} {precision} offload={offload}/{offload_param}"
        assert_trains_like(got, ref, precision, label, clip=0.5)
        assert got["gathered_on_device"], label
        assert not got["placement"], f"{label}:\n" + "\n".join(got["placement"])
        ops = {op for op, _ in got["logged"]}
        assert {path for _, path in got["logged"]} <= {"gloo", "gloo-ar"}, got["logged"]
        if stage > 0:
            assert "reduce_scatter" in ops, got["logged"]  # the gradient partition (through all_reduce)
        if stage in (1, 2, 3):
            assert "all_gather" in ops, got["logged"]  # the updated weights / stage 3's fetches
    for name, value in ranks[0]["params"].items():  # both ranks hold the same weights after every gather
        assert torch.equal(value, ranks[1]["params"][name]), name


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))) * self.scale, y)


def _zero_init_lifecycle(rank: int, world: int, root: str) -> dict[str, Any]:
    """zero.Init partitions a model across the two ranks through the GPU, GatheredParameters reads it whole
    and keeps rank 0's edit, stage 3 trains it, a checkpoint saved at stage 3 loads into stage 2."""
    import ds_strategy
    from ds_strategy.zero import GatheredParameters, Init

    dev = device()
    torch.manual_seed(0)
    with Init():
        model = Small()
    shards = {n: p.numel() for n, p in model.named_parameters()}
    with GatheredParameters(list(model.parameters())):
        whole = {n: (p.detach().cpu().clone(), on_device(p)) for n, p in model.named_parameters()}
    with GatheredParameters([model.scale], modifier_rank=0):
        if rank == 0:
            model.scale.data.mul_(2)
    cfg = config(stage=3, micro=MICRO, gas=1, lr=LR)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for x, y in batches(2, MICRO * world, seed=3):
        x, y = (t[rank * MICRO : (rank + 1) * MICRO].to(dev) for t in (x, y))
        engine.backward(engine(x, y))
        engine.step()
    with GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    engine.save_checkpoint(root, tag="s3")
    saved = full_masters(engine)
    engine.destroy()
    torch.manual_seed(1)
    fresh = Small()
    other, *_ = ds_strategy.initialize(
        model=fresh, model_parameters=fresh.parameters(), config=config(stage=2, micro=MICRO, gas=1, lr=LR, bucket=64)
    )
    other.load_checkpoint(root, tag="s3")
    loaded = full_masters(other)
    other.destroy()
    return {"shards": shards, "whole": whole, "trained": trained, "saved": saved, "loaded": loaded}


def test_zero_init_gathered_parameters_and_checkpoint_across_two_processes(tmp_path: Path) -> None:
    results = run(_zero_init_lifecycle, str(tmp_path))
    torch.manual_seed(0)
    ref = Small()
    for r in results:
        assert all(n == 0 for n in r["shards"].values()), r["shards"]  # partitioned at construction
        for name, p in ref.named_parameters():
            value, was_on_device = r["whole"][name]
            assert was_on_device, name
            torch.testing.assert_close(value, p.detach(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(r["loaded"], r["saved"], rtol=0, atol=0)
    torch.testing.assert_close(results[0]["trained"], results[1]["trained"], rtol=0, atol=0)
    with torch.no_grad():
        ref.scale.mul_(2)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for x, y in batches(2, MICRO * WORLD, seed=3):
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(results[0]["trained"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
