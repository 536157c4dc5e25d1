"""CPUAdam and the fused Adam kernel against torch.optim.Adam / AdamW, their pure-torch twin, and the
separate ops the fused offload pass replaces (unscale, inf/nan check, clip, 16-bit copy-out)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_strategy.ops import CPUAdam, fallback, fused_adam_step
from ds_strategy.ops import optim_step as optim_step_module
from tests.gil import assert_releases_the_gil
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
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("size", SIZES)
def test_matches_torch_optim(cpu_kernels: bool, size: int, adamw_mode: bool, weight_decay: float) -> None:
    groups = make_groups(size, seed=size)
    ours = CPUAdam(clone_groups(groups), weight_decay=weight_decay, adamw_mode=adamw_mode)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls(clone_groups(groups), weight_decay=weight_decay)
    run_side_by_side(ours, ref)
    assert_same_trajectory(ours, ref, ADAM_KEYS, **TORCH_TOL)
    for p in params_of(ours):
        assert ours.state[p]["step"].item() == 20.0


def _flat_state(size: int, seed: int, grad_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "p": torch.randn(size, generator=gen),
        "g": (torch.randn(size, generator=gen) * 64).to(grad_dtype),
        "m": torch.randn(size, generator=gen) * 0.1,
        "v": torch.rand(size, generator=gen) * 0.01,
    }


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", SIZES)
def test_kernel_equals_its_pure_torch_twin_bitwise(cpu_kernels: bool, size: int, grad_dtype: torch.dtype) -> None:
    # Every option at once: unscale + clip, L2 decay in one call, AdamW decay in the next, no bias correction.
    a = _flat_state(size, seed=size, grad_dtype=grad_dtype)
    b = _clone(a)
    outs = (torch.empty(size, dtype=torch.bfloat16), torch.empty(size, dtype=torch.bfloat16))
    for step, (adamw_mode, bias_correction) in enumerate([(False, True), (True, False), (True, True)], start=1):
        kwargs: dict[str, Any] = dict(HYPER, weight_decay=0.05, step=step, adamw_mode=adamw_mode,
                                      bias_correction=bias_correction, grad_scale=64.0, clip_coef=0.7)  # fmt: skip
        torch.ops.ds_strategy.adam_step_([a["p"]], [a["g"]], [a["m"]], [a["v"]], [outs[0]], **kwargs)
        fallback.adam_step_([b["p"]], [b["g"]], [b["m"]], [b["v"]], [outs[1]], **kwargs)
        for key in ("p", "m", "v"):
            torch.testing.assert_close(a[key], b[key], **BITWISE)
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", SIZES)
def test_16bit_copy_out_is_the_rounded_fp32_result(cpu_kernels: bool, size: int, out_dtype: torch.dtype) -> None:
    s = _flat_state(size, seed=size + 1)
    s["p"][: min(size, 3)] *= 70000.0  # beyond fp16's range: must round to inf there, stay finite in bf16
    out = torch.full((size,), float("nan"), dtype=out_dtype)
    fused_adam_step(s["p"], s["g"], s["m"], s["v"], step=1, lr=1e-2, out_16bit=out)
    # Bitwise: round to nearest even of the updated fp32 master, as torch's own conversion does.
    assert torch.equal(out.view(torch.int16), s["p"].to(out_dtype).view(torch.int16))


def test_16bit_copy_out_keeps_nan(cpu_kernels: bool) -> None:
    s = _flat_state(33, seed=3)
    s["p"][[0, 20, 32]] = float("nan")  # SIMD body and scalar tail
    out = torch.zeros(33, dtype=torch.bfloat16)
    fused_adam_step(s["p"], s["g"], s["m"], s["v"], step=1, lr=1e-2, out_16bit=out)
    assert torch.isnan(out[[0, 20, 32]]).all() and torch.isfinite(out[1:20]).all()


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_fused_unscale_and_clip_equal_the_separate_ops(cpu_kernels: bool, grad_dtype: torch.dtype) -> None:
    loss_scale, clip_coef = 1024.0, 0.37
    fused = _flat_state(4097, seed=7, grad_dtype=grad_dtype)
    separate = _clone(fused)
    out_fused, out_separate = torch.empty(4097, dtype=torch.bfloat16), torch.empty(4097, dtype=torch.bfloat16)
    found = fused_adam_step(fused["p"], fused["g"], fused["m"], fused["v"], step=3, lr=1e-3, weight_decay=0.01,
                            grad_scale=loss_scale, clip_coef=clip_coef, out_16bit=out_fused)  # fmt: skip
    # The separate ops: GradScaler's unscale + inf check, the clip multiply, the step, the bf16 copy.
    grads = [separate["g"].float()]
    found_inf = torch.zeros(())
    inv_scale = torch.tensor(1.0 / loss_scale, dtype=torch.float64).float()
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    grads[0].mul_(clip_coef)
    fused_adam_step(separate["p"], grads[0], separate["m"], separate["v"], step=3, lr=1e-3, weight_decay=0.01)
    out_separate.copy_(separate["p"])
    assert found.item() == found_inf.item() == 0.0
    for key in ("p", "m", "v"):
        torch.testing.assert_close(fused[key], separate[key], **BITWISE)
    assert torch.equal(out_fused, out_separate)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_nonfinite_grad_skips_the_whole_update(cpu_kernels: bool, bad: float, where: str) -> None:
    tensors = [_flat_state(n, seed=n) for n in (17, 70_001, 15)]  # the bad one is in the middle tensor
    index = {"first": 0, "middle": 35_000, "last": 70_000}[where]
    tensors[1]["g"][index] = bad
    before = [_clone(t) for t in tensors]
    outs = [torch.zeros(t["p"].shape, dtype=torch.bfloat16) for t in tensors]
    found = fused_adam_step([t["p"] for t in tensors], [t["g"] for t in tensors], [t["m"] for t in tensors],
                            [t["v"] for t in tensors], step=1, lr=1e-2, grad_scale=128.0, out_16bit=outs,
                            skip_if_nonfinite=True)  # fmt: skip
    # Same flag as GradScaler's check on the same gradients.
    found_inf = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([t["g"].clone() for t in tensors], found_inf, torch.ones(()))
    assert found.item() == found_inf.item() == 1.0
    for t, b, out in zip(tensors, before, outs, strict=True):
        for key in ("p", "m", "v"):
            assert torch.equal(t[key], b[key]), "a skipped step wrote to the parameters or state"
        assert not out.any(), "a skipped step wrote the 16-bit copy"


def test_without_skip_the_flag_is_still_reported(cpu_kernels: bool) -> None:
    s = _flat_state(4097, seed=11)
    s["g"][4096] = float("nan")  # scalar tail
    assert fused_adam_step(s["p"], s["g"], s["m"], s["v"], step=1, lr=1e-2).item() == 1.0
    s = _flat_state(4097, seed=11)
    s["g"][5] = float("inf")  # SIMD body
    assert fused_adam_step(s["p"], s["g"], s["m"], s["v"], step=1, lr=1e-2).item() == 1.0
    s = _flat_state(4097, seed=11)
    assert fused_adam_step(s["p"], s["g"], s["m"], s["v"], step=1, lr=1e-2, skip_if_nonfinite=True).item() == 0.0


def test_op_boundary_checks(cpu_kernels: bool) -> None:
    op = torch.ops.ds_strategy.adam_step_
    kw: dict[str, Any] = dict(HYPER, weight_decay=0.0, step=1, adamw_mode=True, bias_correction=True)
    p, g, m, v = torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match=r"params\[0\] is not contiguous"):
        op([p.t()], [g], [m], [v], [], **kw)
    with pytest.raises(RuntimeError, match=r"exp_avg_sqs\[0\] is not contiguous"):
        op([p], [g], [m], [v.t()], [], **kw)
    with pytest.raises(RuntimeError, match=r"params\[1\] has dtype Double"):
        op([p, p.double()], [g, g], [m, m], [v, v], [], **kw)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape \[16\] but params\[0\] has shape \[4, 4\]"):
        op([p], [g.view(16)], [m], [v], [], **kw)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has dtype Int"):
        op([p], [g.int()], [m], [v], [], **kw)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] has dtype BFloat16"):
        op([p], [g], [m.bfloat16()], [v], [], **kw)
    with pytest.raises(RuntimeError, match=r"got 1 params but 2 grads"):
        op([p], [g, g], [m], [v], [], **kw)
    with pytest.raises(RuntimeError, match=r"out_16bit\[0\] has dtype Float"):
        op([p], [g], [m], [v], [torch.zeros(4, 4)], **kw)
    with pytest.raises(RuntimeError, match=r"grad_scale must be a positive"):
        op([p], [g], [m], [v], [], **{**kw, "grad_scale": 0.0})
    with pytest.raises(RuntimeError, match=r"step must be >= 1"):
        op([p], [g], [m], [v], [], **{**kw, "step": 0})


def test_strided_parameters_are_stepped_in_place(cpu_kernels: bool) -> None:
    base = torch.randn(64, 33)
    ours_param = torch.nn.Parameter(base.clone().t())  # non-contiguous
    ref_param = torch.nn.Parameter(base.clone().t())
    ours, ref = CPUAdam([ours_param], weight_decay=0.1), torch.optim.AdamW([ref_param], weight_decay=0.1)
    run_side_by_side(ours, ref, steps=5)
    assert not ours_param.is_contiguous()
    assert_same_trajectory(ours, ref, ADAM_KEYS, **TORCH_TOL)


def test_pure_torch_fallback_gives_the_kernel_result(cpu_kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    groups = make_groups(4097, seed=1)
    with_kernel = CPUAdam(clone_groups(groups), weight_decay=0.1, bias_correction=False)
    without = CPUAdam(clone_groups(groups), weight_decay=0.1, bias_correction=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        for a, b in zip(params_of(with_kernel), params_of(without), strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        with_kernel.step()
        with monkeypatch.context() as m:
            m.setattr(optim_step_module, "kernel_usable", lambda *_: False)
            without.step()
    assert_same_trajectory(with_kernel, without, ADAM_KEYS, **BITWISE)


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
def test_state_dict_round_trips_with_torch_optim(cpu_kernels: bool, adamw_mode: bool) -> None:
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    groups = make_groups(4097, seed=5)
    for first_is_ours in (True, False):
        first = (CPUAdam(clone_groups(groups), weight_decay=0.1, adamw_mode=adamw_mode) if first_is_ours
                 else torch_cls(clone_groups(groups), weight_decay=0.1))  # fmt: skip
        witness = torch_cls(clone_groups(groups), weight_decay=0.1)  # trains 20 steps without interruption
        run_side_by_side(first, witness, steps=10, seed=1)
        # The other implementation, built with the *other* mode's default, continues from the state dict.
        second_params = clone_groups([{**g, "params": [p.detach() for p in g["params"]]} for g in first.param_groups])
        second = (torch_cls(second_params) if first_is_ours
                  else CPUAdam(second_params, adamw_mode=not adamw_mode))  # fmt: skip
        second.load_state_dict(first.state_dict())
        run_side_by_side(second, witness, steps=10, seed=2)
        assert_same_trajectory(second, witness, ADAM_KEYS, **TORCH_TOL)
        for p in params_of(second):
            assert second.state[p]["step"].item() == 20.0


def test_step_extras_on_the_optimizer(cpu_kernels: bool) -> None:
    a, b = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(30))
    opt = CPUAdam([a, b])
    a.grad, b.grad = torch.randn(100) * 8, torch.randn(30) * 8
    b.grad[3] = float("nan")
    before = (a.detach().clone(), b.detach().clone())
    opt.step(grad_scale=8.0, skip_if_nonfinite=True)
    assert opt.found_inf is not None and opt.found_inf.item() == 1.0
    assert torch.equal(a, before[0]) and torch.equal(b, before[1]) and not opt.state
    b.grad[3] = 0.0
    half = torch.zeros(100, dtype=torch.bfloat16)
    opt.step(grad_scale=8.0, clip_coef=0.5, out_16bit={a: half}, skip_if_nonfinite=True)
    assert opt.found_inf is not None and opt.found_inf.item() == 0.0
    assert opt.state[a]["step"].item() == 1.0 and torch.equal(half, a.detach().bfloat16())


@pytest.mark.serial
def test_kernel_releases_the_gil(cpu_kernels: bool) -> None:
    # One long call (a 4M-element step listed 8 times) while a pure-Python thread counts.
    n = 4_000_000
    p, g, m, v = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    assert_releases_the_gil(lambda: fused_adam_step([p] * 8, [g] * 8, [m] * 8, [v] * 8, step=1, lr=1e-3))
