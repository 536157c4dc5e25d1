"""Shared helpers of the optimizer-kernel tests: parameter groups, 20-step runs, random gradients."""

from __future__ import annotations

from typing import Any

import torch

SIZES = (1, 15, 17, 4097, 1_000_003)
STEPS = 20
# Kernel vs torch.optim: equal except that torch's CPU float32 sqrt (MKL VML) is not correctly rounded
# while the kernels' is (IEEE): the last bit of sqrt(exp_avg_sq) differs for ~1% of elements, which moves
# a parameter by at most a few float32 ulps over 20 steps (measured: max |diff| 4.8e-7 on values ~N(0, 1)).
# Everything else (m, v in AdamW mode, Adagrad's sum) is bitwise equal; these tolerances are ~4 ulps.
TORCH_TOL: dict[str, float] = dict(rtol=1e-6, atol=1e-6)
BITWISE: dict[str, float] = dict(rtol=0.0, atol=0.0)


def make_groups(size: int, seed: int) -> list[dict[str, Any]]:
    """Three groups with different learning rates: the size under test, a 2-D and a tiny tensor."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {"params": [torch.randn(size, generator=gen)], "lr": 1e-2},
        {"params": [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen)], "lr": 3e-3},
        {"params": [torch.randn(2, generator=gen)], "lr": 5e-4},
    ]


def clone_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**g, "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]} for g in groups]


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def run_side_by_side(
    ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, steps: int = STEPS, seed: int = 0
) -> None:
    """Feed both optimizers the same random gradients for ``steps`` steps."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(params_of(ours), params_of(ref), strict=True):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()


def assert_same_trajectory(
    ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, keys: tuple[str, ...], **tol: float
) -> None:
    for a, b in zip(params_of(ours), params_of(ref), strict=True):
        torch.testing.assert_close(a, b, **tol)
        for key in keys:
            torch.testing.assert_close(ours.state[a][key], ref.state[b][key], **tol)
