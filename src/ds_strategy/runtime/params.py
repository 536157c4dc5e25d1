"""Turning what the user passed (module, parameters, param-group dicts, a client optimizer) into the
engine's param groups, and wiring an optimizer to the flat fp32 masters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

import ds_strategy.ops as ops
from ds_strategy.config import DeepSpeedConfig
from ds_strategy.log import get_logger

from .optimizers import PER_TENSOR_TYPES, build_optimizer, is_cpu_kernel_optimizer, tested_optimizer_types

log = get_logger(__name__)

ParamsArg = Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None
OptimizerArg = Optimizer | Callable[..., Optimizer] | None


def param_groups(module: nn.Module, optimizer: OptimizerArg, model_parameters: ParamsArg) -> list[dict[str, Any]]:
    """Param-group dicts (``params`` + hyperparameters): a client optimizer's groups, else
    ``model_parameters`` (tensors or group dicts), else all of ``module.parameters()``."""
    if isinstance(optimizer, Optimizer):
        groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is not None:
        items = list(model_parameters)
        if items and all(isinstance(i, dict) for i in items):
            groups = [dict(i) for i in items if isinstance(i, dict)]
        elif all(isinstance(i, torch.Tensor) for i in items):
            groups = [{"params": items}]
        else:
            raise TypeError("model_parameters must be an iterable of tensors or of param-group dicts")
    else:
        groups = [{"params": list(module.parameters())}]
    for g in groups:
        g["params"] = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
    return groups


def named_trainable_groups(
    module: nn.Module, groups: Sequence[dict[str, Any]]
) -> tuple[list[list[tuple[str, nn.Parameter]]], dict[nn.Parameter, int]]:
    """Per group, its trainable ``(name, param)`` pairs in reverse registration order (backward order,
    see [Note: the flat layout]); plus every module parameter's registration index."""
    names: dict[nn.Parameter, str] = {}
    registration: dict[nn.Parameter, int] = {}
    for i, (name, p) in enumerate(module.named_parameters()):
        names[p] = name
        registration[p] = i
    seen: set[nn.Parameter] = set()
    out: list[list[tuple[str, nn.Parameter]]] = []
    for gi, group in enumerate(groups):
        named = []
        for p in group["params"]:
            if p not in names:
                raise ValueError(
                    f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a parameter of the "
                    "model; pass the model's own parameters (model.parameters() or named groups of them)"
                )
            if p in seen:
                raise ValueError(f"parameter {names[p]!r} appears in more than one param group")
            seen.add(p)
            if p.requires_grad:
                if not p.is_floating_point():
                    raise ValueError(f"parameter {names[p]!r} is {p.dtype}; only floating-point parameters train")
                named.append((names[p], p))
        named.sort(key=lambda item: -registration[item[1]])
        out.append(named)
    left_out = [n for p, n in names.items() if p.requires_grad and p not in seen]
    if left_out:
        log.warning(
            "%d trainable parameters are in no optimizer param group and will not be updated: %s",
            len(left_out),
            ", ".join(left_out[:8]) + (" ..." if len(left_out) > 8 else ""),
        )
    return out, registration


def attach_optimizer(
    optimizer: OptimizerArg,
    groups: Sequence[dict[str, Any]],
    masters: Sequence[Sequence[nn.Parameter]],
    config: DeepSpeedConfig,
    *,
    master_device: torch.device,
    offload: bool,
    whole: bool = False,
) -> Optimizer | None:
    """The optimizer, stepping ``masters``: a client optimizer rewired (its group dicts, hence its
    hyperparameters and any scheduler built on them, are kept), a client factory called, or the
    config's ``optimizer`` block built. None when there is neither (an engine for evaluation). ``whole``:
    the stage laid parameters out whole, and ``masters`` are a per-tensor optimizer's shaped tensors."""
    stage = config.zero_stage
    rewired = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(m)}
        for g, m in zip(groups, masters, strict=True)
    ]
    if isinstance(optimizer, Optimizer):  # checked by the engine before the model was touched
        for group, params in zip(optimizer.param_groups, masters, strict=True):
            group["params"] = list(params)
        if offload and config.zero_force_ds_cpu_optimizer and not is_cpu_kernel_optimizer(optimizer):
            return kernel_twin(optimizer)  # check_client_optimizer let only twinnable types through
        return optimizer
    if optimizer is not None:
        built = optimizer(rewired)
        check_client_optimizer(built, stage=stage, offload=offload, config=config, whole=whole)
        return built
    if config.optimizer is None:
        return None
    return build_optimizer(config.optimizer, rewired, device=master_device, offload=offload)


def check_client_optimizer(
    optimizer: Optimizer, *, stage: int, offload: bool, config: DeepSpeedConfig, whole: bool = True
) -> None:
    """Refuse a client optimizer the engine cannot step correctly (``whole``: the stage lays parameters out
    whole, as a per-tensor optimizer needs)."""
    name = type(optimizer).__name__
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            f"the client optimizer {name} already holds state; pass a freshly constructed optimizer "
            "(its state would not match the flat fp32 master weights the engine steps)"
        )
    per_tensor = is_per_tensor_optimizer(optimizer)
    if per_tensor and not whole:
        raise ValueError(
            f"{name} computes per-tensor quantities (norms, factored second moments, orthogonalisation of each "
            "parameter's shape), but the optimizer factory passed to initialize(optimizer=...) was called only "
            "after the parameters were laid out in flat buckets for an element-wise optimizer. Pass the "
            f"optimizer itself (initialize(optimizer={name}(model.parameters(), ...))) or name it in the config's "
            '"optimizer" block ("Muon", "Adafactor"), so ZeRO lays each parameter out whole'
        )
    if per_tensor and offload and config.zero_force_ds_cpu_optimizer:
        raise ValueError(
            f"optimizer offload with the per-tensor optimizer {name}: ds_strategy's CPU kernels are element-wise; "
            'set "zero_force_ds_cpu_optimizer": false to step the offloaded masters with it on the host'
        )
    if (
        stage > 0
        and not per_tensor  # stepped whole, as in one process: [Note: per-tensor optimizers under ZeRO]
        and not isinstance(optimizer, tested_optimizer_types())
        and not config.zero_allow_untested_optimizer
    ):
        raise ValueError(
            f"ZeRO stage {stage} steps flat partitions of the parameters, which is only verified for "
            f"{', '.join(t.__name__ for t in tested_optimizer_types())}; {name} is untested. Set "
            '"zero_allow_untested_optimizer": true in the config to use it anyway (its step must treat each '
            "element independently)."
        )
    if offload and config.zero_force_ds_cpu_optimizer and not is_cpu_kernel_optimizer(optimizer):
        if type(optimizer) in _KERNEL_TWINS:
            return  # attach_optimizer steps it with its kernel twin
        raise ValueError(
            f"optimizer offload with the client optimizer {name} would step the CPU masters with a generic "
            'implementation. Put the optimizer in the config\'s "optimizer" block (ds_strategy builds its CPU '
            'optimizer), or set "zero_force_ds_cpu_optimizer": false to keep yours.'
        )


# Optimizers whose step depends on each parameter's whole tensor or shape (matched on the class name, so
# apex's FusedLAMB, transformers' Adafactor, torch's Adafactor and third-party Muon/Shampoo/LARS all count).
_PER_TENSOR_NAMES = ("adafactor", "lamb", "lars", "muon", "shampoo", "novograd", "sm3")


def is_per_tensor_optimizer(optimizer: Optimizer | type) -> bool:
    """Whether an optimizer (or its class) steps each parameter as a whole tensor: its ``zero_per_tensor``
    attribute when it declares one, else its class name ([Note: per-tensor optimizers under ZeRO])."""
    declared = getattr(optimizer, "zero_per_tensor", None)
    if declared is not None:
        return bool(declared)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return any(key in cls.__name__.lower() for key in _PER_TENSOR_NAMES)


def wants_whole_params(optimizer: OptimizerArg, config: DeepSpeedConfig) -> bool:
    """Whether the stage must lay parameters out whole: a per-tensor client optimizer (or class), or a
    per-tensor type in the config's ``optimizer`` block when the client passes none."""
    if isinstance(optimizer, Optimizer):
        return is_per_tensor_optimizer(optimizer)
    factory = getattr(optimizer, "func", optimizer)  # a functools.partial of an optimizer class counts too
    if isinstance(factory, type):
        return is_per_tensor_optimizer(factory)
    if optimizer is None and config.optimizer is not None:
        return config.optimizer.type in PER_TENSOR_TYPES
    return False


# torch optimizers whose kernel twin keeps their exact math and state-dict format (ds_strategy.ops).
_KERNEL_TWINS: dict[type, str] = {
    torch.optim.AdamW: "CPUAdam",
    torch.optim.Adam: "CPUAdam",
    torch.optim.Adagrad: "CPUAdagrad",
}


def kernel_twin(optimizer: Optimizer) -> Optimizer:
    """The C++ kernel optimizer stepping the very same param-group dicts as a fresh torch Adam / AdamW /
    Adagrad, for optimizer offload (zero_force_ds_cpu_optimizer).

    DeepSpeed refuses a torch optimizer under offload; here a Lightning ``configure_optimizers`` returning
    ``torch.optim.AdamW`` just works. The group dicts are shared, not copied, so a scheduler built on the
    client optimizer still drives the learning rate, and the state-dict format is torch's.
    """
    twin_type = getattr(ops, _KERNEL_TWINS[type(optimizer)])
    twin: Optimizer = twin_type([{"params": list(g["params"])} for g in optimizer.param_groups])
    for group in optimizer.param_groups:
        for key, value in twin.defaults.items():
            group.setdefault(key, value)
        if twin_type is ops.CPUAdam:
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
            group["adamw_mode"] = group["decoupled_weight_decay"] = decoupled
        twin._normalize_group(group)  # type: ignore[attr-defined]  # refuses amsgrad / maximize, naming them
    twin.param_groups = optimizer.param_groups
    log.info("optimizer offload: %s steps through its C++ twin %s", type(optimizer).__name__, twin_type.__name__)
    return twin
