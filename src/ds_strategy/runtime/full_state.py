"""DeepSpeed's full-state access functions (``deepspeed.utils.safe_get_full_fp32_param`` and family), importable
from ``ds_strategy.utils``; docs/engine.md (Full-state access) says when each is valid.

Every function takes a model parameter as the user sees it (``engine.module.fc.weight``) and works at every
stage (0-3), with or without optimizer offload:

- ``safe_get_full_*`` return a new fp32 tensor shaped like the parameter. At stages 1-3 the value is
  partitioned across ranks and assembling it is a collective: **every rank must call them**, for the same
  parameters in the same order. At stage 0 they communicate nothing.
- ``safe_set_full_*`` take the whole value, the same on every rank, and keep this rank's part; no
  communication. ``safe_set_full_fp32_param`` also updates the compute-dtype weights, so the next forward
  uses the new value (DeepSpeed updates only the fp32 copy until the next step).
- ``safe_get_local_*`` / ``safe_set_local_*``: this rank's fragment as a 1-D fp32 tensor (a copy), no
  communication. Rank r's fragments, concatenated in rank order, are the flattened parameter; a fragment
  may be empty, and its length differs between ranks (DeepSpeed's stage 3 gives every rank ``ceil(n / W)``
  elements with padding; here a parameter is cut where the flat layout's shards fall, without padding). At
  stage 0 the fragment is the whole parameter. ``safe_set_local_fp32_param`` updates this rank's copy of
  the weights only: at stages 1-2 the other ranks' replicas catch up at the next step's all-gather.
- An MoE model's expert parameter (``engine.module.moe.deepspeed_moe.experts.deepspeed_experts.<local>...``)
  is the expert this rank holds: its full value is that expert's (assembled over its expert-data-parallel
  group, the ranks holding the same experts), and its local fragments concatenate in that group's rank
  order. ``engine.full_state_dict()`` and ``save_hf_weights`` give every expert under its global name.
- Parameters the engine does not train (``requires_grad=False``, left out of the optimizer, or no engine
  at all): the getters return None and the setters do nothing, as DeepSpeed's do. Exception, also
  DeepSpeed's: ``safe_get_full_grad`` / ``safe_set_full_grad`` use ``param.grad`` whenever it is set.

When: fp32 weights and optimizer states at any time outside forward and backward (optimizer states exist
after the first ``engine.step()``). Gradients after ``engine.backward()`` at the accumulation boundary
and before ``engine.step()``: the averaged, unscaled gradient of the window (what DDP would hold; under
fp16 DeepSpeed returns it times the loss scale). At stages 2-3 they are readable after every backward
(the running sum of the window so far); at stages 0-1 only after the boundary backward (earlier: a
RuntimeError saying so). A gradient set here is what ``engine.step()`` clips and applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from .zero.access import Kind, find

_Scope = Literal["full", "local"]


def _get(param: torch.Tensor, scope: _Scope, kind: Kind, key: str | None = None) -> torch.Tensor | None:
    """The engine's ``kind`` of ``param`` (whole, or this rank's fragment); None for a tensor no engine trains."""
    found = find(param)
    if found is None:
        return None
    access, group, index = found
    read = access.get_full if scope == "full" else access.get_local
    return read(group, index, kind, key)


def _set(param: torch.Tensor, value: torch.Tensor, scope: _Scope, kind: Kind, key: str | None = None) -> None:
    """Write the engine's ``kind`` of ``param`` (whole, or this rank's fragment); nothing for a tensor no engine
    trains."""
    found = find(param)
    if found is None:
        return
    access, group, index = found
    write = access.set_full if scope == "full" else access.set_local
    write(group, index, value, kind, key)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's fp32 master weight, shaped like the parameter. Collective at stages 1-3."""
    return _get(param, "full", "fp32_param")


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master weight and its compute-dtype weights to ``value`` (the parameter's
    shape; the same on every rank)."""
    _set(param, value, "full", "fp32_param")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer's ``optim_state_key`` state (e.g. ``"exp_avg"``) for the parameter, fp32, shaped like
    it. Collective at stages 1-3; KeyError before the optimizer created that state (its first step)."""
    return _get(param, "full", "optimizer_state", optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer's ``optim_state_key`` state for the parameter (``value`` shaped like it)."""
    _set(param, value, "full", "optimizer_state", optim_state_key)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's averaged, unscaled gradient (fp32, shaped like it), or ``param.grad`` when set.
    Collective at stages 1-3; valid after the boundary backward and before ``engine.step()``."""
    if param.grad is not None:
        return param.grad
    return _get(param, "full", "grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the parameter's gradient (averaged and unscaled, shaped like it) for the coming step."""
    if param.grad is not None:
        param.grad.copy_(value)
        return
    _set(param, value, "full", "grad")


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragment of the parameter's fp32 master weight (1-D, possibly empty)."""
    return _get(param, "local", "fp32_param")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's fragment of the fp32 master weight (and of this rank's compute-dtype copy)."""
    _set(param, value, "local", "fp32_param")


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragment of the averaged, unscaled gradient (1-D fp32, possibly empty)."""
    return _get(param, "local", "grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's fragment of the gradient (averaged and unscaled) for the coming step."""
    _set(param, value, "local", "grad")


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's fragment of the optimizer's ``optim_state_key`` state (1-D fp32, possibly empty)."""
    return _get(param, "local", "optimizer_state", optim_state_key)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's fragment of the optimizer's ``optim_state_key`` state."""
    _set(param, value, "local", "optimizer_state", optim_state_key)


def safe_update_full_grad_vectorized(
    param_list: Sequence[torch.nn.Parameter], update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]
) -> None:
    """For each parameter: gradient = ``update_func(full gradient, param)``. Collective at stages 1-3 (one
    assembly per parameter, in list order). Parameters with ``param.grad`` set are updated in place."""
    for p in param_list:
        if p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))
            continue
        full = _get(p, "full", "grad")
        if full is not None:
            _set(p, update_func(full, p), "full", "grad")
