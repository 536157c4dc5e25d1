"""``GatheredParameters`` and ``register_external_parameter``: user-facing access to stage 3's partitions.

``with GatheredParameters(params, modifier_rank=0):`` makes ``params`` whole on every rank for the block
(a collective: every rank enters it, in the same order). With ``modifier_rank`` set, that rank's edits
are broadcast on exit and become the new partitions (compute-dtype shards and fp32 masters; in bf16/fp16
training the masters take the 16-bit value). Works on parameters of a stage-3 engine and on parameters
partitioned by ``zero.Init`` before any engine exists (e.g. a custom re-initialisation); anything else
(stages 0-2, plain tensors) is already whole and passes through, with ``modifier_rank``'s values still
broadcast so every rank agrees.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .init import compute_device, gather_init_param, init_shard, partition_param
from .param_gather import EXTERNAL_ATTR
from .placement import ZERO3_ATTR


class GatheredParameters:
    """Temporary full access to (possibly partitioned) parameters; see the module docstring."""

    def __init__(
        self,
        params: torch.Tensor | Iterable[torch.Tensor],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._stages: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        self._init_params: list[nn.Parameter] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for p in self.params:
            ref = getattr(p, ZERO3_ATTR, None)
            if ref is not None:
                self._stages.setdefault(id(ref[0]), (ref[0], []))
            elif init_shard(p) is not None and isinstance(p, nn.Parameter):
                self._init_params.append(p)
        for stage, keys in self._stages.values():
            keys.extend(stage.placement.keys_for(self.params))
            stage.placement.gather_for_user(keys)
        for p in self._init_params:
            info = init_shard(p)
            assert info is not None
            p.data = gather_init_param(p).clone().view(info.shape)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.enabled:
            return
        modifier = self.modifier_rank if exc_type is None else None  # after an error: drop the edits
        for stage, keys in self._stages.values():
            stage.placement.release_for_user(keys, modifier)
        with torch.no_grad():
            for p in self._init_params:
                info = init_shard(p)
                assert info is not None
                if modifier is not None:
                    delattr(p, "_ds_init_shard")
                    partition_param(p, info.coll, src=modifier)  # broadcasts the modifier's value
                else:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            plain = self._plain() if modifier is not None else []
            if modifier is not None and plain:
                from .collectives import Collectives

                coll = Collectives()
                device = compute_device()
                for t in plain:
                    if t.device == device:
                        coll.broadcast(t.data, src=modifier)
                        continue
                    staged = t.data.to(device)  # a host tensor travels through the device (NCCL takes no other)
                    coll.broadcast(staged, src=modifier)
                    t.data.copy_(staged)

    def _plain(self) -> list[torch.Tensor]:
        """Whole parameters that neither stage 3 nor zero.Init manages."""
        managed = {id(p) for p in self._init_params}
        return [p for p in self.params if getattr(p, ZERO3_ATTR, None) is None and id(p) not in managed]


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    """Gather ``parameter`` whenever ``module`` runs, for a forward that uses a parameter its owning module
    does not (e.g. ``logits = h @ self.embed.weight.T`` in the parent). Call before ``initialize`` (or
    after: an existing stage-3 engine picks it up at once)."""
    external = getattr(module, EXTERNAL_ATTR, None)
    if external is None:
        external = []
        setattr(module, EXTERNAL_ATTR, external)
    if not any(p is parameter for p in external):
        external.append(parameter)
    ref = getattr(parameter, ZERO3_ATTR, None)
    if ref is not None:
        ref[0].gatherer.add_external(module, parameter)
