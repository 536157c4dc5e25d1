"""``CPUAdam``, ``CPUAdagrad`` and ``CPULion``: torch.optim.Optimizer subclasses over the fused kernels.

State lives in ``self.state`` under torch.optim's key names (``step``/``exp_avg``/``exp_avg_sq`` for Adam,
``step``/``sum`` for Adagrad, ``exp_avg`` for Lion), as tensors of the parameter's shape, so a state dict
saved by ``CPUAdam`` loads into ``torch.optim.AdamW`` / ``Adam`` (and ``CPUAdagrad``'s into
``torch.optim.Adagrad``) and back, and training continues identically. As with torch.optim, the
hyperparameters of a loaded state dict win over the constructor's (``CPUAdam`` loading an ``Adam`` state
dict steps with L2 weight decay, loading an ``AdamW`` one with decoupled decay).

Strided parameters: the kernels never write through a temporary copy on their own (the op rejects
non-contiguous tensors); the classes step a non-contiguous parameter through an explicit contiguous
buffer and copy the result back into the parameter, which gives exactly the in-place result.

``step()`` also accepts the fused-pass extras of :mod:`ds_strategy.ops.optim_step`: ``grad_scale`` (loss
scale to divide out), ``clip_coef`` and ``out_16bit`` (a mapping parameter -> bf16/fp16 tensor of the same
shape receiving the updated parameter) and ``skip_if_nonfinite``: when true and some gradient holds inf or
NaN, nothing is updated (not even the step counts) and ``found_inf`` is set (decided on the host: one read
of the gradients' inf/nan flag). ``skip_on_device`` is the engine's sync-free variant: every kernel call
skips on its own device when its gradients hold inf or NaN, and the host never learns it (the engine makes
every gradient non-finite for a step it skips: see [Note: the step on the device] in runtime/zero/step.py);
the step counts advance either way.

[Note: step counts on the host]
The step count (bias correction, Adagrad's lr decay) is a kernel argument, so it must be known on the
host: ``state["step"]`` is always a host tensor (as in torch.optim's non-capturable optimizers), counted on
the host, so a step never reads a device counter. A state dict loaded with its counts on the device has
them brought to the host once, when it is loaded. ``found_inf`` stays on the parameters' device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ds_strategy.ops.norm import multi_tensor_l2norm
from ds_strategy.ops.optim_step import fused_adagrad_step, fused_adam_step, fused_lion_step
from ds_strategy.ops.optimizer_base import OptimizerBase

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]]
_HOST = torch.device("cpu")


class _Bucket:
    """Parameters of one group stepped by one kernel call (same step count, same copy-out choice)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.states: list[list[torch.Tensor]] = []
        self.out: list[torch.Tensor] = []
        self.write_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (original, contiguous buffer)

    def add(self, p: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], out: torch.Tensor | None) -> None:
        if grad.is_sparse:
            raise RuntimeError("ds_strategy optimizers do not support sparse gradients")
        # step() runs under no_grad: the parameter itself is handed to the kernel (no detach per tensor).
        if not p.is_contiguous():
            buffer = p.detach().contiguous()  # explicit buffer, copied back after the step
            self.write_back.append((p.detach(), buffer))
            p = buffer
        self.params.append(p)
        self.grads.append(grad if grad.is_contiguous() else grad.contiguous())  # read only: a copy is harmless
        if not self.states:
            self.states = [[] for _ in states]
        for column, s in zip(self.states, states, strict=True):
            column.append(s)
        if out is not None:
            if not out.is_contiguous():
                buffer = torch.empty_like(out, memory_format=torch.contiguous_format)
                self.write_back.append((out, buffer))
                out = buffer
            self.out.append(out)

    def finish(self) -> None:
        for original, buffer in self.write_back:
            original.copy_(buffer)


class _KernelOptimizer(OptimizerBase):
    """Shared plumbing: state creation, bucketing by step count, fused-pass extras, strided params."""

    _state_keys: tuple[str, ...] = ()
    _counts_steps = True

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.found_inf: torch.Tensor | None = None  # 0-dim flag of the last step()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._normalize_group(group)
        for per_param in self.state.values():  # see [Note: step counts on the host]
            step = per_param.get("step") if isinstance(per_param, dict) else None
            if isinstance(step, torch.Tensor) and step.device != _HOST:
                per_param["step"] = torch.tensor(float(step), dtype=torch.float32, device=_HOST)

    def _normalize_group(self, group: dict[str, Any]) -> None:
        """Reconcile a group loaded from another optimizer's state dict (override per class)."""

    def _state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            if self._counts_steps:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=_HOST)
            for key in self._state_keys:
                state[key] = self._initial_state(p, key, group)
        elif self._counts_steps and state["step"].device != _HOST:  # placed by hand: brought back once
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=_HOST)
        for key in self._state_keys:
            s = state[key]
            if s.dtype != p.dtype or s.device != p.device or not s.is_contiguous():
                # State is ours (not a view the user holds): replacing it by a contiguous copy is safe.
                state[key] = s.to(device=p.device, dtype=p.dtype, memory_format=torch.contiguous_format)
        return state

    def _initial_state(self, p: torch.Tensor, key: str, group: dict[str, Any]) -> torch.Tensor:
        return torch.zeros_like(p, memory_format=torch.contiguous_format)

    def _kernel_step(self, bucket: _Bucket, group: dict[str, Any], step: int, extras: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        grad_scale: float = 1.0,
        clip_coef: float = 1.0,
        out_16bit: Mapping[torch.Tensor, torch.Tensor] | None = None,
        skip_if_nonfinite: bool = False,
        skip_on_device: bool = False,
    ) -> float | None:
        loss = self._closure_loss(closure)
        with_grad = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        if skip_if_nonfinite:
            grads = [p.grad for _, ps in with_grad for p in ps if p.grad is not None]
            # One fused read of every gradient (the norm kernel), before any state is touched.
            if grads and bool(multi_tensor_l2norm(grads)[1]):
                self.found_inf = torch.tensor(1.0)
                return loss
        extras = dict(grad_scale=grad_scale, clip_coef=clip_coef, skip_if_nonfinite=skip_on_device)
        found: list[torch.Tensor] = []
        for group, params in with_grad:
            states = [self._state(p, group) for p in params]
            steps = [0] * len(params)
            if self._counts_steps and params:
                # Host tensors (see [Note: step counts on the host]): one foreach add and one read of host
                # memory for the whole group, not two tiny ops per tensor.
                counters = [s["step"] for s in states]
                torch._foreach_add_(counters, 1.0)
                steps = [int(x) for x in torch.stack(counters).tolist()]
            buckets: dict[tuple[int, bool, torch.device], _Bucket] = {}
            keys = self._state_keys
            for p, state, step in zip(params, states, steps, strict=True):
                out = out_16bit.get(p) if out_16bit is not None else None
                bucket = buckets.setdefault((step, out is not None, p.device), _Bucket())
                bucket.add(p, p.grad, [state[k] for k in keys], out)
            for (step, _, _), bucket in buckets.items():
                found.append(self._kernel_step(bucket, group, step, extras))
                bucket.finish()
        # On the parameters' device (no read): a flag per kernel call, the first call's device for all.
        if found:
            first = found[0].device
            self.found_inf = torch.stack([f if f.device == first else f.to(first) for f in found]).amax()
        else:
            self.found_inf = torch.tensor(0.0)
        return loss


def is_kernel_optimizer(optimizer: object) -> bool:
    """Whether ``optimizer`` is one of these kernel optimizers (what the engine's fused step drives: see
    [Note: the fused optimizer pass] in runtime/zero/step.py)."""
    return isinstance(optimizer, _KernelOptimizer)


class CPUAdam(_KernelOptimizer):
    """Adam / AdamW over the fused CPU kernel (the CUDA kernel for CUDA parameters).

    ``adamw_mode=True`` (default) decays weights decoupled from the gradient, as ``torch.optim.AdamW``;
    ``False`` adds ``weight_decay * p`` to the gradient, as ``torch.optim.Adam``. ``bias_correction=False``
    drops both bias corrections (DeepSpeed's option). Note the default ``weight_decay=0`` (DeepSpeed's),
    where torch.optim.AdamW defaults to 0.01.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        *,
        amsgrad: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"CPUAdam: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        if amsgrad:
            raise ValueError("CPUAdam: amsgrad=True is not supported; use torch.optim.Adam(amsgrad=True)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                        bias_correction=bias_correction, decoupled_weight_decay=adamw_mode, amsgrad=False,
                        maximize=False)  # fmt: skip
        super().__init__(params, defaults)

    def _normalize_group(self, group: dict[str, Any]) -> None:
        # torch.optim.Adam/AdamW state dicts say the mode as decoupled_weight_decay; ours keep both in sync.
        group["adamw_mode"] = bool(group.get("decoupled_weight_decay", group["adamw_mode"]))
        group["decoupled_weight_decay"] = group["adamw_mode"]
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("CPUAdam cannot continue a state dict saved with amsgrad=True or maximize=True")

    def _kernel_step(self, bucket: _Bucket, group: dict[str, Any], step: int, extras: dict[str, Any]) -> torch.Tensor:
        exp_avgs, exp_avg_sqs = bucket.states
        return fused_adam_step(
            bucket.params, bucket.grads, exp_avgs, exp_avg_sqs, step=step, lr=float(group["lr"]),
            betas=(float(group["betas"][0]), float(group["betas"][1])), eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]), adamw_mode=bool(group["adamw_mode"]),
            bias_correction=bool(group["bias_correction"]), out_16bit=bucket.out or None, **extras,
        )  # fmt: skip


class FusedAdam(CPUAdam):
    """``CPUAdam`` under the name GPU users look for: the step runs the fused multi-tensor CUDA kernel for
    CUDA parameters and the OpenMP + SIMD kernel for CPU ones (the choice is per device, automatically)."""


class CPUAdagrad(_KernelOptimizer):
    """torch.optim.Adagrad (dense gradients, L2 weight decay, ``lr_decay``) over the fused CPU kernel."""

    _state_keys = ("sum",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
    ) -> None:
        if lr < 0 or lr_decay < 0 or weight_decay < 0 or initial_accumulator_value < 0 or eps < 0:
            raise ValueError(
                f"CPUAdagrad: invalid lr={lr}, lr_decay={lr_decay}, weight_decay={weight_decay}, "
                f"initial_accumulator_value={initial_accumulator_value} or eps={eps}"
            )
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, maximize=False)  # fmt: skip
        super().__init__(params, defaults)
        # As torch.optim.Adagrad: state exists from the start, so a state dict saved before the first step
        # also loads into torch's Adagrad (whose step expects 'sum' to exist).
        for group in self.param_groups:
            for p in group["params"]:
                self._state(p, group)

    def _initial_state(self, p: torch.Tensor, key: str, group: dict[str, Any]) -> torch.Tensor:
        return torch.full_like(p, group["initial_accumulator_value"], memory_format=torch.contiguous_format)

    def _normalize_group(self, group: dict[str, Any]) -> None:
        if group.get("maximize"):
            raise ValueError("CPUAdagrad cannot continue a state dict saved with maximize=True")

    def _kernel_step(self, bucket: _Bucket, group: dict[str, Any], step: int, extras: dict[str, Any]) -> torch.Tensor:
        (sums,) = bucket.states
        return fused_adagrad_step(
            bucket.params, bucket.grads, sums, step=step, lr=float(group["lr"]), lr_decay=float(group["lr_decay"]),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]), out_16bit=bucket.out or None,
            **extras,
        )  # fmt: skip


class CPULion(_KernelOptimizer):
    """Lion (Chen et al. 2023), decoupled weight decay, over the fused CPU kernel:
    ``p *= 1 - lr*wd;  p -= lr * sign(beta1*m + (1-beta1)*g);  m = beta2*m + (1-beta2)*g``."""

    _state_keys = ("exp_avg",)
    _counts_steps = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),  # DeepSpeedCPULion's default
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"CPULion: invalid lr={lr}, betas={betas} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _kernel_step(self, bucket: _Bucket, group: dict[str, Any], step: int, extras: dict[str, Any]) -> torch.Tensor:
        (exp_avgs,) = bucket.states
        return fused_lion_step(
            bucket.params, bucket.grads, exp_avgs, lr=float(group["lr"]),
            betas=(float(group["betas"][0]), float(group["betas"][1])), weight_decay=float(group["weight_decay"]),
            out_16bit=bucket.out or None, **extras,
        )  # fmt: skip
