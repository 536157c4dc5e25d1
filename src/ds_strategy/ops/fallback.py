"""Pure-torch twins of every kernel: used when no compiler works, and as the reference in tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def multi_tensor_l2norm(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Global L2 norm over all tensors (accumulated in float64) and a 0/1 flag for any inf or NaN."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return zero, zero.clone()
    squares = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors])
    found_inf = torch.stack([~torch.isfinite(t).all() for t in tensors]).any()
    return squares.sum().sqrt().float(), found_inf.float()


# --- optimizer steps -------------------------------------------------------------------------------------
# Twins of torch.ops.ds_strategy.{adam,adagrad,lion}_step_ (csrc/optim, csrc/includes/optim_math.h), written
# with the torch ops whose CPU kernels round exactly like the C++ math: `add(alpha=)`, `addcmul_` and `lerp_`
# are one fused multiply-add, `addcdiv_` is `self + (value * t1) / t2`. One difference is deliberate:
# torch.sqrt on CPU float32 is not correctly rounded (it differs from IEEE sqrt in the last bit for ~1% of
# inputs), so the square root is taken in float64 and rounded once, which is the IEEE float32 sqrt the
# kernels use. On fp32 inputs these functions therefore reproduce the kernels bit for bit.


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the kernels hold their scalars."""
    return float(torch.tensor(x, dtype=torch.float32))


def _ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    return t.double().sqrt().to(t.dtype) if t.dtype == torch.float32 else t.sqrt()


def _grad_nonfinite(grads: Sequence[torch.Tensor]) -> bool:
    return any(not bool(torch.isfinite(g).all()) for g in grads)


def _prepared_grad(grad: torch.Tensor, dtype: torch.dtype, grad_scale: float, clip_coef: float) -> torch.Tensor:
    g = grad.to(dtype)
    inv_scale, clip = _f32(1.0 / grad_scale), _f32(clip_coef)
    if inv_scale == 1.0 and clip == 1.0:
        return g
    return g.mul(inv_scale).mul_(clip)  # unscale, then clip: two roundings, as the separate ops


def _step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    out_16bit: Sequence[torch.Tensor],
    grad_scale: float,
    clip_coef: float,
    skip_if_nonfinite: bool,
    update: Callable[..., None],
) -> torch.Tensor:
    """What every step does around its update rule, as the kernels do: found_inf from the raw gradients (with
    ``skip_if_nonfinite`` a non-finite one leaves everything as it is); ``update(p, g, *states of p)`` with
    each gradient unscaled and clipped in the parameter's dtype; the 16-bit copies; found_inf."""
    device = params[0].device if params else torch.device("cpu")
    found = _grad_nonfinite(grads)
    if found and skip_if_nonfinite:
        return torch.tensor(1.0, device=device)
    for p, grad, *state in zip(params, grads, *states, strict=True):
        update(p, _prepared_grad(grad, p.dtype, grad_scale, clip_coef), *state)
    for p, out in zip(params, out_16bit, strict=False):
        out.copy_(p)  # round to nearest even
    return torch.tensor(1.0 if found else 0.0, device=device)


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    out_16bit: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    skip_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Adam (L2 weight decay) or AdamW (decoupled) step in place; returns found_inf as the kernel does."""
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    step_size, bc2_sqrt = lr / bc1, math.sqrt(bc2)

    def update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
        if weight_decay != 0:
            if adamw_mode:
                p.mul_(1.0 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (_ieee_sqrt(v) / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)

    states = (exp_avgs, exp_avg_sqs)
    return _step(params, grads, states, out_16bit, grad_scale, clip_coef, skip_if_nonfinite, update)


def adagrad_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    state_sums: Sequence[torch.Tensor],
    out_16bit: Sequence[torch.Tensor],
    *,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    skip_if_nonfinite: bool = False,
) -> torch.Tensor:
    """torch.optim.Adagrad's step (dense gradients) in place; returns found_inf."""
    clr = lr / (1.0 + (step - 1) * lr_decay)

    def update(p: torch.Tensor, g: torch.Tensor, state_sum: torch.Tensor) -> None:
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        state_sum.addcmul_(g, g, value=1.0)
        std = _ieee_sqrt(state_sum).add_(eps)
        p.addcdiv_(g, std, value=-clr)

    return _step(params, grads, (state_sums,), out_16bit, grad_scale, clip_coef, skip_if_nonfinite, update)


def lion_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    out_16bit: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    skip_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Lion step in place (decoupled weight decay); the reference the kernel is tested against.

    p *= 1 - lr * wd;  p -= lr * sign(beta1 * m + (1 - beta1) * g);  m = beta2 * m + (1 - beta2) * g
    """

    def update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> None:
        if weight_decay != 0:
            p.mul_(1.0 - lr * weight_decay)
        p.add_((m * beta1).add_(g, alpha=1.0 - beta1).sign_(), alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1.0 - beta2)

    return _step(params, grads, (exp_avgs,), out_16bit, grad_scale, clip_coef, skip_if_nonfinite, update)


def optim_traffic_ceiling_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
) -> None:
    """Benchmark-only twin of the memory-traffic probe: p += g, m += g, v += g."""
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        p.add_(g)
        m.add_(g)
        v.add_(g)


# --- block-wise symmetric quantization (ZeRO++) -----------------------------------------------------------
# Twins of torch.ops.ds_strategy.{quantize_blockwise,dequantize_blockwise_,dequantize_sum_} (csrc/quant,
# csrc/includes/quant_math.h): the same fp32 products, round-half-to-even, clamp and int4 nibble packing.
def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() == 1 else t


def quantize_blockwise(x: torch.Tensor, block_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of ``x`` (1-D, or 2-D rows quantized independently) in blocks of ``block_size``."""
    qmax = 7 if bits == 4 else 127
    rows = _rows(x).float()
    r, n = rows.shape
    nb = -(-n // block_size)
    padded = torch.zeros(r, nb * block_size, dtype=torch.float32, device=x.device)
    padded[:, :n] = rows
    blocks = padded.view(r, nb, block_size)
    absmax = blocks.abs().amax(dim=2)
    bad = ~torch.isfinite(blocks).all(dim=2)
    scales = torch.where(bad, torch.full_like(absmax, math.nan), absmax / qmax)
    # A tensor division, not ``qmax / absmax``: torch computes a scalar-by-tensor division as a reciprocal
    # times the scalar, which rounds differently from the kernels' one fp32 division.
    inv = torch.where(bad | (absmax == 0), torch.zeros_like(absmax), torch.full_like(absmax, float(qmax)) / absmax)
    q = torch.round(blocks * inv.unsqueeze(2)).clamp_(-qmax, qmax).to(torch.int8).view(r, -1)[:, :n]
    if bits == 4:
        if n % 2:
            q = torch.cat([q, torch.zeros(r, 1, dtype=torch.int8, device=x.device)], dim=1)
        pairs = q.view(r, -1, 2).to(torch.int32) & 0xF
        q = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).to(torch.uint8).view(torch.int8)
    if x.dim() == 1:
        return q.reshape(-1).contiguous(), scales.reshape(-1)
    return q.contiguous(), scales


def _unpack(q: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """int8 rows x n values of ``q`` (rows x packed bytes)."""
    if bits == 8:
        return q
    u = q.view(torch.uint8).to(torch.int32)
    nib = torch.stack([u & 0xF, (u >> 4) & 0xF], dim=2).view(q.shape[0], -1)[:, :n]
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def _values_and_scales(
    q: torch.Tensor, scales: torch.Tensor, block_size: int, bits: int, rows: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    values = _unpack(q.reshape(rows, -1), n, bits).float()
    return values, scales.reshape(rows, -1).repeat_interleave(block_size, dim=1)[:, :n]


def dequantize_blockwise_(
    q: torch.Tensor, scales: torch.Tensor, block_size: int, bits: int, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (1-D, or rows x n) = the dequantized values of ``q`` / ``scales``."""
    view = _rows(out)
    values, per_element = _values_and_scales(q, scales, block_size, bits, view.shape[0], view.shape[1])
    view.copy_(values * per_element)
    return out


def dequantize_sum_(
    q: torch.Tensor, scales: torch.Tensor, block_size: int, bits: int, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (n, fp32) = the sum of ``q``'s dequantized rows, added in row order in fp32, each term one fused
    multiply-add (``addcmul_``), as the kernels do."""
    values, per_element = _values_and_scales(q, scales, block_size, bits, q.shape[0], out.numel())
    acc = torch.zeros_like(out)
    for v, s in zip(values, per_element, strict=True):
        acc.addcmul_(v, s)
    out.copy_(acc)
    return out
