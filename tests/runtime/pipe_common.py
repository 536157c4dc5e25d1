"""Shared pieces of the pipeline tests: a small tied model as layer specs, data, and the one-process reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_strategy.pipe import LayerSpec, TiedLayerSpec

SEED = 1234
WIDTH = 8


def transposed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied projection used the other way round (as an output head reuses an embedding)."""
    return x @ module.weight.to(x.dtype)


def specs() -> list[Any]:
    return [
        TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False),
        LayerSpec(nn.Linear, WIDTH, 16),
        nn.Tanh(),
        LayerSpec(nn.Linear, 16, WIDTH),
        nn.Tanh(),
        TiedLayerSpec("proj", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=transposed),
        LayerSpec(nn.Linear, WIDTH, 4),
    ]


def data(steps: int, dp: int, micro_batches: int, micro: int) -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """data[step][dp_rank][micro_batch] = (x, y)."""
    g = torch.Generator().manual_seed(7)
    return [
        [
            [(torch.randn(micro, WIDTH, generator=g), torch.randn(micro, 4, generator=g)) for _ in range(micro_batches)]
            for _ in range(dp)
        ]
        for _ in range(steps)
    ]


class Reference(nn.Module):
    """The same layers in one process, built with the same per-layer seeds; names as a one-stage PipelineModule."""

    def __init__(self) -> None:
        super().__init__()
        self.funcs: list[Any] = []
        self.tied_modules = nn.ModuleDict()
        for idx, spec in enumerate(specs()):
            torch.manual_seed(SEED + idx)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                mod = self.tied_modules[spec.key]
                self.funcs.append(mod if spec.forward_fn is None else (lambda x, f=spec.forward_fn, m=mod: f(m, x)))
            elif isinstance(spec, LayerSpec):
                mod = spec.build()
                self.add_module(str(idx), mod)
                self.funcs.append(mod)
            else:
                self.add_module(str(idx), spec)
                self.funcs.append(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.funcs:
            x = f(x)
        return x


def reference_run(
    batches: list[list[list[tuple[torch.Tensor, torch.Tensor]]]],
    *,
    lr: float,
    clip: float,
    lrs: list[float] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``lrs``: the learning rate of each step (a scheduler's), else ``lr`` throughout. ``optimizer``: builds the
    optimizer from the parameters (default: AdamW, ``lr``, no weight decay, as ``pipe_config``)."""
    model = Reference()
    opt = (optimizer or (lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)))(list(model.parameters()))
    losses = []
    for i, step in enumerate(batches):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[i]
        opt.zero_grad()
        pieces = [nn.functional.mse_loss(model(x), y) for per_rank in step for x, y in per_rank]
        loss = torch.stack(pieces).mean()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipe_config(*, micro: int, gas: int, lr: float, clip: float, stage: int = 1, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50},
    }
    cfg.update(extra)
    return cfg
