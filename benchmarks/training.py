"""GPT training-step plumbing shared by the end-to-end and checkpoint benchmarks: the model and its batches,
one DeepSpeed-format config for every engine, and a step function per peer (torch DDP / FSDP2, DeepSpeed,
ds_strategy) with the same optimizer settings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_strategy.demo.model import GPT, GPTConfig

# The ~25M-parameter GPT of the engine and stage-3 issues, and a tiny one for smoke runs.
SHAPE = {"layers": 8, "d": 512, "seq": 256, "micro": 4}
QUICK_SHAPE = {"layers": 2, "d": 128, "seq": 64, "micro": 2}
WARMUP = 2

STAGE3 = {  # the model has ~25M parameters; a block ~3.1M, its largest Linear ~1M
    "stage3_prefetch_bucket_size": 3_200_000,  # the next block ahead (one fetch unit)
    "stage3_max_live_parameters": 7_000_000,  # the block in use, the next one and the rest
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 10_000,
}


class LossModel(nn.Module):
    """Wraps the GPT so that ``model(batch)`` returns the loss, as engine(batch) expects."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.gpt.loss(*batch)


def model_and_batches(shape: dict[str, int], steps: int, rank: int) -> tuple[LossModel, list[Any]]:
    """The same initial weights on every rank (seed 0), different random tokens per rank."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=shape["seq"], n_layer=shape["layers"], n_embd=shape["d"], n_head=8)
    model = LossModel(cfg)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = [torch.randint(0, 256, (shape["micro"], shape["seq"] + 1), generator=gen) for _ in range(steps)]
    return model, [(t[:, :-1], t[:, 1:]) for t in tokens]


def ds_config(stage: int, offload: bool, micro: int) -> dict[str, Any]:
    """One config for DeepSpeed and ds_strategy alike: AdamW, fp32; stage 3 gets the STAGE3 keys;
    offload moves the optimizer (and at stage 3 the parameters) to host memory."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(STAGE3)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # both engines' default is 1.0; the torch peers (DDP, FSDP2) do not clip
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def time_steps(step: Callable[[Any], None], batches: list[Any], warmup: int = WARMUP) -> float:
    """Median seconds per step after ``warmup`` untimed steps (a median, as the issues' targets ask: one
    step slowed by other work on a shared machine moves a mean by a fifth of its delay, a median not)."""
    for b in batches[:warmup]:
        step(b)
    seconds = []
    for b in batches[warmup:]:
        start = time.perf_counter()
        step(b)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) if seconds else 0.0


def torch_step(module: nn.Module) -> Callable[[Any], None]:
    """One training step of a torch-wrapped model (DDP, FSDP2) with the engines' optimizer settings."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

    def step(b: Any) -> None:
        loss = module(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_engine(peer: str, model: nn.Module, config: dict[str, Any]) -> Any:
    """DeepSpeed's or our engine, both built by ``initialize`` from the same config."""
    if peer == "deepspeed":
        import deepspeed as lib  # DS_ACCELERATOR=cpu is set by benchmarks/__init__.py
    else:
        import ds_strategy as lib  # type: ignore[no-redef]
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def engine_step(engine: Any) -> Callable[[Any], None]:
    def step(b: Any) -> None:
        loss = engine(b)
        engine.backward(loss)
        engine.step()

    return step


def peer_step(peer: str, model: LossModel, stage: int, offload: bool, micro: int) -> Callable[[Any], None]:
    """The training step of ``peer`` ("torch DDP", "torch FSDP2", "deepspeed" or "ds_strategy")."""
    if peer == "torch DDP":
        return torch_step(nn.parallel.DistributedDataParallel(model))
    if peer == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.gpt.blocks:  # one all-gather per block, as a user of FSDP2 would wrap it
            fully_shard(block)
        return torch_step(fully_shard(model))
    return engine_step(build_engine(peer, model, ds_config(stage, offload, micro)))
