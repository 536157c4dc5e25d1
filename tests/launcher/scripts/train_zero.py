"""A DeepSpeed-style training script for the launcher tests: ZeRO stage 2 through ``initialize()``.

Every rank records what the launcher gave it (rank variables, --local_rank, forwarded variables) in
``OUT/rank<R>.json`` and its final weights in ``OUT/rank<R>.pt``; the test compares them with each other
and with single-process SGD on the same global batches (``reference_weights``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STEPS, MICRO, LR, MOMENTUM = 4, 4, 0.05, 0.9
ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = MICRO * world
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(STEPS)]


def reference_weights(world: int) -> list[torch.Tensor]:
    """Single-process SGD on the whole global batch: what every rank must end with."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in global_batches(world):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from ds_strategy.runtime import initialize

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # the reference is plain SGD (DeepSpeed's default clips at 1.0)
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
    }
    engine, _, _, _ = initialize(model=make_model(), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    for x, y in global_batches(world):
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    out = Path(args.out)
    torch.save([p.detach().clone() for p in engine.module.parameters()], out / f"rank{rank}.pt")
    record = {
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
        "local_rank_arg": args.local_rank,
        "argv": sys.argv[1:],
        "forwarded": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "DS_TEST_USER_VAR")},
        "dist_world": world,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
