"""The global gradient norm of a ZeRO stage's reduced gradients, agreed by every rank (for clipping and the
inf/nan check of a step).

Still scaled: the engine divides by the loss scale and the averaging factor. Partitioned stages combine
the per-rank squares with one all-reduce of ``[norm**2, found_inf]``; the result stays on the device,
never read on the host (see [Note: the step on the device] in step.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ds_strategy.accelerator.spans import span
from ds_strategy.ops import multi_tensor_l2norm
from ds_strategy.ops.norm import multi_tensor_sum_of_squares

from ..swap import OptimizerSwapper
from .buffers import GroupStorage
from .collectives import Collectives


class NormStage(Protocol):
    """What the norm reads of its stage (``ZeroStage``)."""

    groups: list[GroupStorage]
    swapper: OptimizerSwapper | None
    partitioned: bool
    coll: Collectives
    compute_device: torch.device
    stepper: Any  # OptimizerStep: its tiles, for NVMe's streamed gradients

    @property
    def options(self) -> Any: ...

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]: ...

    def comm_of(self, group: int) -> Collectives: ...


def grad_norm(stage: NormStage) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm, any inf/nan) of the reduced gradients of every rank, agreed by all ranks: 0-dim tensors on
    the compute device (fp64 norm, fp32 flag 1.0/0.0)."""
    with span("ds::grad_norm"):
        if stage.swapper is not None and stage.swapper.grad_of:  # NVMe: the gradients stream in tile by tile
            norm, found_inf = _streamed(stage.swapper, stage.stepper.tiles())
        elif stage.options.group_comms:
            return _over_groups(stage)
        else:
            grads = [t for g in range(len(stage.groups)) for t in stage.reduced_grads_of(g)]
            norm, found_inf = multi_tensor_l2norm(grads)
        if stage.partitioned and stage.coll.world_size > 1:
            both = torch.stack([norm.float() ** 2, found_inf.float()]).to(stage.compute_device)
            stage.coll.all_reduce(both)
            sq, inf = both[0], both[1]
            return sq.double().sqrt(), ((inf > 0) | ~torch.isfinite(sq)).float()
        norm = norm.to(stage.compute_device)  # a rank with no gradient at all has a host zero
        return norm.double(), ((found_inf.to(norm.device) > 0) | ~torch.isfinite(norm)).float()


def _streamed(swapper: OptimizerSwapper, tiles: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """NVMe offload: the norm of gradients read tile by tile from the swap files (host memory: no device read)."""
    total, found = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float32)
    for grads in swapper.stream_grads(tiles):
        sq, inf = multi_tensor_sum_of_squares(grads)
        total += sq
        found = torch.maximum(found, inf.float())
    return total.sqrt().float(), found


def _over_groups(stage: NormStage) -> tuple[torch.Tensor, torch.Tensor]:
    """The global norm when param groups reduce over different communicators (an MoE model's experts).

    Every element of the model's gradient is counted once: a partitioned group's shards are disjoint
    across its communicator, and the communicators of the expert groups of one ``ep_size`` hold disjoint
    experts, so summing the squares over the whole data-parallel group counts each once; a replicated
    group (stage 0) is held by each of its communicator's ranks, so its square is weighted by
    ``1 / its size``. One all-reduce of ``[weighted norm**2, found_inf]`` (fp64) over the stage's group.
    """
    both = torch.zeros(2, dtype=torch.float64, device=stage.compute_device)
    for g in range(len(stage.groups)):
        pieces = stage.reduced_grads_of(g)
        if not pieces:
            continue
        norm, inf = multi_tensor_l2norm(pieces)
        weight = 1.0 if stage.partitioned else 1.0 / stage.comm_of(g).world_size
        both[0] += (norm.double() ** 2 * weight).to(both.device)
        both[1] += inf.double().to(both.device)
    if stage.coll.world_size > 1:
        stage.coll.all_reduce(both)
    sq, inf = both[0], both[1]
    return sq.sqrt(), ((inf > 0) | ~torch.isfinite(sq)).float()
