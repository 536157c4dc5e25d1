"""CPUAdagrad against torch.optim.Adagrad and CPULion against its pure-torch reference, 20 steps, several
param groups, sizes that hit every SIMD tail."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_strategy.ops import CPUAdagrad, CPULion, fallback, fused_adagrad_step, fused_lion_step
from tests.ops.optim_helpers import (
    BITWISE,
    SIZES,
    TORCH_TOL,
    assert_same_trajectory,
    clone_groups,
    make_groups,
    params_of,
    run_side_by_side,
)

pytestmark = pytest.mark.kernels


class ReferenceLion(torch.optim.Optimizer):
    """Lion stepped by the pure-torch reference (ds_strategy.ops.fallback.lion_step_), one tensor at a time."""

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0) -> None:  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                fallback.lion_step_([p], [p.grad], [m], [], lr=group["lr"], beta1=group["betas"][0],
                                    beta2=group["betas"][1], weight_decay=group["weight_decay"])  # fmt: skip


@pytest.mark.parametrize(("weight_decay", "lr_decay"), [(0.0, 0.0), (0.1, 0.01)])
@pytest.mark.parametrize("size", SIZES)
def test_adagrad_matches_torch_optim(cpu_kernels: bool, size: int, weight_decay: float, lr_decay: float) -> None:
    groups = make_groups(size, seed=size)
    kw = dict(weight_decay=weight_decay, lr_decay=lr_decay, initial_accumulator_value=0.05)
    ours, ref = CPUAdagrad(clone_groups(groups), **kw), torch.optim.Adagrad(clone_groups(groups), **kw)
    run_side_by_side(ours, ref)
    assert_same_trajectory(ours, ref, ("sum",), **TORCH_TOL)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("size", SIZES)
def test_lion_matches_reference_bitwise(cpu_kernels: bool, size: int, weight_decay: float) -> None:
    groups = make_groups(size, seed=size)
    ours = CPULion(clone_groups(groups), weight_decay=weight_decay)
    ref = ReferenceLion(clone_groups(groups), weight_decay=weight_decay)
    run_side_by_side(ours, ref)
    # Lion has no square root: kernel and reference round every operation identically.
    assert_same_trajectory(ours, ref, ("exp_avg",), **BITWISE)


def test_lion_moves_each_weight_by_lr(cpu_kernels: bool) -> None:
    # Independent of the reference: with m = 0 the first update is exactly -lr * sign(g).
    p, g, m = torch.zeros(37), torch.randn(37), torch.zeros(37)
    g[5] = 0.0
    fused_lion_step(p, g, m, lr=0.25)
    torch.testing.assert_close(p, -0.25 * torch.sign(g), **BITWISE)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_extras_equal_the_reference(cpu_kernels: bool, grad_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for name in ("adagrad", "lion"):
        p = torch.randn(4097, generator=gen)
        g = (torch.randn(4097, generator=gen) * 32).to(grad_dtype)
        s = torch.rand(4097, generator=gen)
        a, b = (
            [p.clone(), s.clone(), torch.empty(4097, dtype=torch.float16)],
            [p.clone(), s.clone(), torch.empty(4097, dtype=torch.float16)],
        )
        extras: dict[str, Any] = dict(grad_scale=32.0, clip_coef=0.9, weight_decay=0.01)
        if name == "adagrad":
            fused_adagrad_step(a[0], g, a[1], step=2, lr=0.1, lr_decay=0.1, out_16bit=a[2], **extras)
            fallback.adagrad_step_([b[0]], [g], [b[1]], [b[2]], step=2, lr=0.1, lr_decay=0.1, eps=1e-10, **extras)
        else:
            fused_lion_step(a[0], g, a[1], lr=0.1, out_16bit=a[2], **extras)
            fallback.lion_step_([b[0]], [g], [b[1]], [b[2]], lr=0.1, beta1=0.9, beta2=0.99, **extras)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), name


def test_nonfinite_skips_adagrad_and_lion(cpu_kernels: bool) -> None:
    p, g, s = torch.randn(100), torch.randn(100), torch.rand(100)
    g[99] = float("inf")
    before = (p.clone(), s.clone())
    assert fused_adagrad_step(p, g, s, step=1, lr=0.1, skip_if_nonfinite=True).item() == 1.0
    assert fused_lion_step(p, g, s, lr=0.1, skip_if_nonfinite=True).item() == 1.0
    assert torch.equal(p, before[0]) and torch.equal(s, before[1])


def test_op_boundary_checks(cpu_kernels: bool) -> None:
    p = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match=r"adagrad_step_: state_sums\[0\] is not contiguous"):
        torch.ops.ds_strategy.adagrad_step_([p], [p], [p.clone().t()], [], lr=0.1, lr_decay=0.0, eps=1e-10,
                                            weight_decay=0.0, step=1)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"lion_step_: grads\[0\] has shape \[8\] but params\[0\]"):
        torch.ops.ds_strategy.lion_step_([p], [p[0]], [p.clone()], [], lr=0.1, beta1=0.9, beta2=0.99,
                                         weight_decay=0.0)  # fmt: skip


def test_adagrad_state_dict_round_trips_with_torch_optim(cpu_kernels: bool) -> None:
    groups = make_groups(4097, seed=9)
    kw = dict(weight_decay=0.1, lr_decay=0.01)
    for first_is_ours in (True, False):
        first = (
            CPUAdagrad(clone_groups(groups), **kw) if first_is_ours else torch.optim.Adagrad(clone_groups(groups), **kw)
        )
        witness = torch.optim.Adagrad(clone_groups(groups), **kw)
        run_side_by_side(first, witness, steps=10, seed=1)
        second_params = clone_groups([{**g, "params": [p.detach() for p in g["params"]]} for g in first.param_groups])
        second = torch.optim.Adagrad(second_params) if first_is_ours else CPUAdagrad(second_params)
        second.load_state_dict(first.state_dict())
        run_side_by_side(second, witness, steps=10, seed=2)
        assert_same_trajectory(second, witness, ("sum",), **TORCH_TOL)
        assert all(second.state[p]["step"].item() == 20.0 for p in params_of(second))


def test_adagrad_state_dict_before_any_step_loads_into_torch(cpu_kernels: bool) -> None:
    p = torch.nn.Parameter(torch.randn(10))
    saved = CPUAdagrad([p], initial_accumulator_value=0.5).state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.Adagrad([q])
    ref.load_state_dict(saved)
    q.grad = torch.ones(10)
    ref.step()
    torch.testing.assert_close(ref.state[q]["sum"], torch.full((10,), 1.5))
