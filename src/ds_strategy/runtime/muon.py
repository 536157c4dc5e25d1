"""Muon for the weight matrices, AdamW for everything else, in one optimizer (``MuonWithAuxAdam``).

``torch.optim.Muon`` steps 2-D parameters only and its documentation asks for AdamW on the rest
(embeddings, biases, norms, heads). One optimizer holding both kinds of param group is what Lightning's
``configure_optimizers``, ``ds_strategy.initialize`` and the config's ``"optimizer": {"type": "Muon"}``
need. Each param group carries ``use_muon``; a step hands the Muon groups to ``torch.optim.Muon`` and the
others to ``torch.optim.AdamW`` (their math, their state keys), all state kept in this optimizer, so its
state dict and checkpoints are one. It steps whole tensors: [Note: per-tensor optimizers under ZeRO].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ds_strategy.ops.optimizer_base import OptimizerBase

from .zero.init import init_shard

# Per kind of group, the hyperparameters it takes (the rest of the constructor's keywords belong to the other).
_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def uses_muon(p: torch.Tensor, embeddings: frozenset[int] = frozenset()) -> bool:
    """Whether ``p`` is a Muon parameter: its own ``use_muon`` attribute if set, else a 2-D tensor that is
    not an embedding table (``embeddings``: ids of those). A parameter partitioned by ``zero.Init`` counts
    with its whole shape."""
    flag = getattr(p, "use_muon", None)
    if flag is not None:
        return bool(flag)
    shard = init_shard(p)
    ndim = p.ndim if shard is None else len(shard.shape)
    return ndim == 2 and id(p) not in embeddings


def embedding_ids(module: nn.Module) -> frozenset[int]:
    """ids of the parameters of ``module``'s ``nn.Embedding`` layers and of every output head a submodule
    names (Hugging Face's ``get_output_embeddings()``, also where the model sits inside a LightningModule or
    a wrapper): AdamW's under Muon's rule, as torch.optim.Muon advises."""
    layers: list[nn.Module] = []
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            layers.append(m)
        getter = getattr(m, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module):
            layers.append(head)
    return frozenset(id(p) for m in layers for p in m.parameters())


def split_for_muon(groups: Iterable[dict[str, Any]], embeddings: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """Each param group without ``use_muon`` cut into its Muon part and its AdamW part (empty parts dropped)."""
    out: list[dict[str, Any]] = []
    for group in groups:
        if "use_muon" in group:
            out.append(dict(group))
            continue
        params = list(group["params"])
        for flag in (True, False):
            part = [p for p in params if uses_muon(p, embeddings) == flag]
            if part:
                out.append({**group, "params": part, "use_muon": flag})
    return out


class MuonWithAuxAdam(OptimizerBase):  # its inner torch optimizers import torch._dynamo all the same
    """Muon on the groups with ``use_muon=True`` (2-D matrices), AdamW on the others.

    Groups without ``use_muon`` are split by ``uses_muon``. Muon groups take ``lr``, ``momentum``,
    ``nesterov``, ``weight_decay``, ``ns_steps``, ``ns_coefficients``, ``eps`` and ``adjust_lr_fn`` (torch.optim
    .Muon's meaning and defaults); AdamW groups take ``lr`` (default ``adam_lr``, else ``lr``), ``betas``
    (``adam_betas``), ``eps`` (``adam_eps``) and ``weight_decay`` (``adam_weight_decay``, else ``weight_decay``).
    ``muon_lr`` (DeepSpeed's config name) is the Muon groups' learning rate, ``lr`` then the AdamW groups'.
    """

    zero_per_tensor = True  # Muon's step is a function of each whole matrix: [Note: per-tensor optimizers under ZeRO]

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        adam_lr: float | None = None,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        adam_weight_decay: float | None = None,
        muon_lr: float | None = None,
    ) -> None:
        items: list[Any] = list(params)
        groups: list[dict[str, Any]] = items if items and isinstance(items[0], dict) else [{"params": items}]
        muon: dict[str, Any] = {
            "lr": lr if muon_lr is None else muon_lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        adam: dict[str, Any] = {
            "lr": lr if adam_lr is None else adam_lr,
            "betas": tuple(adam_betas),
            "eps": adam_eps,
            "weight_decay": weight_decay if adam_weight_decay is None else adam_weight_decay,
        }
        self._kinds = {True: muon, False: adam}
        # torch's own optimizers do the math; built on a stand-in, handed the real groups at each step.
        stand_in = [torch.zeros(2, 2, requires_grad=True)]
        self._muon = torch.optim.Muon(stand_in, **{k: muon[k] for k in _MUON_KEYS})
        self._adam = torch.optim.AdamW(stand_in, **{k: adam[k] for k in _ADAM_KEYS})
        super().__init__(split_for_muon(groups), {"lr": lr})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        for group in split_for_muon([param_group]):
            flag = bool(group["use_muon"])
            inner = self._muon if flag else self._adam
            for key, value in {**inner.defaults, **self._kinds[flag]}.items():
                group.setdefault(key, value)
            super().add_param_group(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            if not any(p.grad is not None for p in group["params"]):
                continue
            inner = self._muon if group["use_muon"] else self._adam
            inner.param_groups = [group]  # the same dict: a scheduler's lr reaches the step
            inner.state = self.state
            inner.step()
        return loss
