"""Functional optimizer steps over flat buffers or lists of tensors: the API ZeRO offload calls each step.

Each function updates parameters and state in place in one pass over memory and can, in the same pass,
unscale the gradients (``grad_scale``: the loss scale they carry, divided out), multiply them by a clipping
coefficient (``clip_coef``) and write the updated parameters as bf16/fp16 into ``out_16bit``. It returns
``found_inf``: a 0-dim float32 tensor on the parameters' device, 1.0 when some gradient element is inf or
NaN (checked on the gradients as given, before unscaling), else 0.0.

The non-finite contract:

* ``skip_if_nonfinite=True``: every gradient is scanned first (a read-only pass); if one element is inf or
  NaN, **nothing is written** (parameters, state and ``out_16bit`` keep their values) and found_inf is 1.
* ``skip_if_nonfinite=False`` (default): one pass; found_inf is still reported, but elements with a
  non-finite gradient have been updated with it. Use this when the caller has checked already: ZeRO needs
  the global gradient norm for clipping before the step anyway, and :func:`multi_tensor_l2norm` returns
  found_inf in that same pass.

Unscale then clip are two float32 multiplies, ``g * float32(1 / grad_scale) * float32(clip_coef)``, exactly
what ``torch._amp_foreach_non_finite_check_and_unscale_`` followed by a clip-coefficient ``mul_`` computes.

Dispatch: fp32 parameters on CPU use the OpenMP + SIMD kernels; Adam on CUDA uses the fused multi-tensor
CUDA kernel (csrc/optim/fused_adam.cu, when it is built; on CUDA ``skip_if_nonfinite`` is decided on the
device, without a host synchronisation); anything else, or a machine without a compiler, uses the pure-torch twins in
:mod:`ds_strategy.ops.fallback`, which give the same results. The ops themselves reject non-contiguous
tensors; the optimizer classes in :mod:`ds_strategy.ops.optimizers` handle strided parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ds_strategy.ops import fallback
from ds_strategy.ops.builder import load_cpu_kernels, load_cuda_kernels

Tensors = torch.Tensor | Sequence[torch.Tensor]
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_OPS = frozenset({"adam_step_"})  # Adagrad and Lion on CUDA use the pure-torch twins


def _as_list(tensors: Tensors | None) -> list[torch.Tensor]:
    if tensors is None:
        return []
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def kernel_usable(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], op: str = "adam_step_") -> bool:
    """Whether the compiled kernel ``op`` can step these tensors (else the pure-torch twin runs)."""
    if not params:
        return False
    device = params[0].device
    if not all(p.device == device and p.dtype == torch.float32 for p in params):
        return False
    if not all(g.dtype in _GRAD_DTYPES and not g.is_sparse for g in grads):
        return False
    if device.type == "cpu":
        return load_cpu_kernels()
    return device.type == "cuda" and op in _CUDA_OPS and load_cuda_kernels()


def _run(name: str, params: list[torch.Tensor], grads: list[torch.Tensor], lists: list[list[torch.Tensor]],
         out: list[torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:  # fmt: skip
    if not params:
        return torch.zeros(())
    if kernel_usable(params, grads, name):
        op: Callable[..., torch.Tensor] = getattr(torch.ops.ds_strategy, name)
    else:
        op = getattr(fallback, name)
    return op(params, grads, *lists, out, **kwargs)


def fused_adam_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out_16bit: Tensors | None = None,
    skip_if_nonfinite: bool = False,
) -> torch.Tensor:
    """One Adam (``adamw_mode=False``: L2 weight decay, as torch.optim.Adam) or AdamW (decoupled, as
    torch.optim.AdamW) step; ``step`` is the count after this update (1 on the first call). Returns found_inf
    (see the module docstring for the contract)."""
    kwargs = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay, step=step,
                  adamw_mode=adamw_mode, bias_correction=bias_correction, grad_scale=grad_scale,
                  clip_coef=clip_coef, skip_if_nonfinite=skip_if_nonfinite)  # fmt: skip
    p, g = _as_list(params), _as_list(grads)
    return _run("adam_step_", p, g, [_as_list(exp_avgs), _as_list(exp_avg_sqs)], _as_list(out_16bit), kwargs)


def fused_adagrad_step(
    params: Tensors,
    grads: Tensors,
    state_sums: Tensors,
    *,
    step: int,
    lr: float,
    lr_decay: float = 0.0,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out_16bit: Tensors | None = None,
    skip_if_nonfinite: bool = False,
) -> torch.Tensor:
    """One torch.optim.Adagrad step (L2 weight decay, ``lr / (1 + (step - 1) * lr_decay)``); returns found_inf."""
    kwargs = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                  clip_coef=clip_coef, skip_if_nonfinite=skip_if_nonfinite)  # fmt: skip
    p, g = _as_list(params), _as_list(grads)
    return _run("adagrad_step_", p, g, [_as_list(state_sums)], _as_list(out_16bit), kwargs)


def fused_lion_step(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 0.0,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out_16bit: Tensors | None = None,
    skip_if_nonfinite: bool = False,
) -> torch.Tensor:
    """One Lion step (decoupled weight decay, as :func:`ds_strategy.ops.fallback.lion_step_`); returns found_inf."""
    kwargs = dict(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, grad_scale=grad_scale,
                  clip_coef=clip_coef, skip_if_nonfinite=skip_if_nonfinite)  # fmt: skip
    p, g = _as_list(params), _as_list(grads)
    return _run("lion_step_", p, g, [_as_list(exp_avgs)], _as_list(out_16bit), kwargs)
