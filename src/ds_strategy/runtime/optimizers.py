"""Optimizers the engine builds from the config's ``optimizer`` block, and the ZeRO compatibility rules.

``_kernel_or_torch`` is the one place that picks between ds_strategy's kernels (``ds_strategy.ops.CPUAdam`` /
``CPUAdagrad`` / ``CPULion`` on CPU, ``FusedAdam`` on CUDA) and ``torch.optim``. Defaults follow DeepSpeed's
optimizers, not torch.optim's (DeepSpeed's Adam/AdamW default to ``weight_decay=0``; its ``Adam`` is decoupled
AdamW unless ``adam_w_mode`` is false).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

import ds_strategy.ops as ops
from ds_strategy.config import OptimizerConfig
from ds_strategy.ops.optimizer_base import OptimizerBase
from ds_strategy.ops.optimizers import is_kernel_optimizer

from .muon import MuonWithAuxAdam

ParamGroups = list[dict[str, Any]]


class Lion(OptimizerBase):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled weight decay.

    update = sign(beta1 * m + (1 - beta1) * g);  p -= lr * (update + wd * p);  m = beta2 * m + (1 - beta2) * g
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: invalid lr={lr}, betas={betas} or weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            avgs = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            beta1, beta2 = group["betas"]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
            update = torch._foreach_mul(avgs, beta1)
            torch._foreach_add_(update, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-group["lr"])
            torch._foreach_mul_(avgs, beta2)
            torch._foreach_add_(avgs, grads, alpha=1.0 - beta2)
        return loss


# Config types whose step is per tensor: the stage lays parameters out whole (runtime/zero/per_tensor.py).
PER_TENSOR_TYPES = ("Muon", "Adafactor")

_KERNELS = {"Adam": "CPUAdam", "AdamW": "CPUAdam", "Adagrad": "CPUAdagrad", "Lion": "CPULion"}


# Types whose step only reads p.grad elementwise, so stepping a flat partition equals stepping the
# parameters one by one: the ones ZeRO accepts without zero_allow_untested_optimizer.
def tested_optimizer_types() -> tuple[type, ...]:
    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.SGD, Lion, *_kernel_types())


def _kernel_types() -> tuple[type, ...]:
    return (ops.CPUAdam, ops.CPUAdagrad, ops.CPULion)


def is_cpu_kernel_optimizer(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is one of ds_strategy's kernel optimizers (what optimizer offload expects, and
    what the engine's fused step drives: see [Note: the fused optimizer pass] in zero/step.py)."""
    return is_kernel_optimizer(optimizer)


def _kernel_or_torch(
    kind: str, *, device: torch.device, bias_correction: bool
) -> tuple[Callable[..., Optimizer], dict[str, Any]]:
    """(constructor, extra kwargs) for ``kind`` in {"Adam", "AdamW", "Adagrad", "Lion", "SGD"}.

    Masters on CPU (offloaded or CPU training) are stepped by the C++ kernels whenever they are built:
    as fast as torch's fused AdamW on the bare step, and they fuse the whole ZeRO optimizer phase
    (unscale, clip, step, 16-bit copy-out) into one pass (docs/performance.md). CUDA masters use the
    fused multi-tensor Adam kernel, everything else torch.optim (fused or foreach).
    """
    kernel = _KERNELS.get(kind)
    on_cpu = device.type == "cpu" and ops.load_cpu_kernels()
    on_cuda = device.type == "cuda" and kind in ("Adam", "AdamW") and ops.load_cuda_kernels()
    if kernel is not None and (on_cpu or on_cuda):
        ctor = ops.FusedAdam if on_cuda else getattr(ops, kernel)
        if kernel == "CPUAdam":
            return ctor, {"adamw_mode": kind == "AdamW", "bias_correction": bias_correction}
        return ctor, {}
    if not bias_correction:
        raise ValueError(
            "optimizer.params.bias_correction=false needs ds_strategy's Adam kernels, which are not "
            "available here (see `python -m ds_strategy.report`); remove the key"
        )
    fused = {"fused": True} if device.type in ("cpu", "cuda") else {"foreach": True}
    if kind == "AdamW":
        return torch.optim.AdamW, fused
    if kind == "Adam":
        return torch.optim.Adam, fused
    if kind == "Adagrad":
        return torch.optim.Adagrad, ({"fused": True} if device.type == "cpu" else {"foreach": True})
    if kind == "SGD":
        return torch.optim.SGD, fused
    if kind == "Lion":
        return Lion, {}
    raise ValueError(f"optimizer type {kind!r} cannot be built by ds_strategy; pass your own optimizer")


_DEFAULTS: dict[str, dict[str, Any]] = {
    "Adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "AdamW": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "Adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
    "Lion": {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0},  # DeepSpeed's FusedLion / CPULion
    "SGD": {"lr": 1e-3},
}
# DeepSpeed-only switches that do not reach torch.optim.
_DROPPED = ("max_grad_norm", "torch_adam", "set_grad_none", "adam_w_mode", "bias_correction", "ns_method")


def build_optimizer(
    config: OptimizerConfig, param_groups: ParamGroups, *, device: torch.device, offload: bool = False
) -> Optimizer:
    """The optimizer ``config`` names, over ``param_groups`` (the engine's flat fp32 masters).

    ``torch_adam: true`` picks torch.optim's Adam/AdamW over the fused kernel, except with optimizer offload
    (``offload``), where DeepSpeed's engine also keeps its CPU Adam.
    """
    params = config.kwargs()
    kind = config.type
    if kind in PER_TENSOR_TYPES:  # torch's math over whole tensors ([Note: per-tensor optimizers under ZeRO])
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k not in _DROPPED}
        if kind == "Muon":
            return MuonWithAuxAdam(param_groups, **params)
        return torch.optim.Adafactor(param_groups, **params)
    if kind == "Adam" and params.get("adam_w_mode", True):
        kind = "AdamW"  # DeepSpeed's Adam is decoupled-weight-decay Adam unless adam_w_mode is false
    ctor, extra = _kernel_or_torch(kind, device=device, bias_correction=bool(params.get("bias_correction", True)))
    kwargs = {**_DEFAULTS[config.type], **{k: v for k, v in params.items() if k not in _DROPPED}}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    torch_adam = bool(params.get("torch_adam", False)) and kind in ("Adam", "AdamW") and not offload
    if torch_adam and not params.get("bias_correction", True):
        raise ValueError(
            "optimizer.params: torch_adam=true selects torch.optim's Adam, which always applies bias correction, "
            "but bias_correction is false; remove one of the two"
        )
    if torch_adam or "fused" in kwargs or "foreach" in kwargs:  # the config chose torch's implementation
        torch_optimizers = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "Adagrad": torch.optim.Adagrad}
        ctor, extra = torch_optimizers.get(kind, ctor), {}
    return ctor(param_groups, **kwargs, **extra)
