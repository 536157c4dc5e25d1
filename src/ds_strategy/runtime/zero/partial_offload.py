"""ZeRO-Offload++'s partial optimizer offload (``offload_optimizer.ratio`` below 1; DeepSpeed's Twin-Flow): a
share of each rank's fp32 masters and optimizer state on the host, stepped by the CPU kernels, the rest on
the compute device, stepped there, the two overlapped.

[Note: the partial offload split]
A stage builds its masters as for a full offload: on the host, one fp32 leaf per bucket of this rank's
partition ([Note: master weights] in buffers.py). ``MasterSplit.place`` then cuts each param group's masters
in two, contiguously in partition order: the leading masters stay on the host, the others move to the
compute device (DeepSpeed's blog: "the first 40% ... on the CPU side"). The cut falls between masters, i.e.
on bucket boundaries: the master is the unit that the optimizer, its state, checkpoints and full-state
access index, as DeepSpeed's unit is its sub-group. It rounds towards the host: the device keeps the most
trailing masters whose elements stay within ``1 - ratio`` of the group's partition, so the host keeps at
least ``ratio`` of it and the device never more than asked. A group of one bucket therefore stays whole on
the host; rank 0 logs the share each group reached and warns when it is more than 0.05 above ``ratio``
(lower ``reduce_bucket_size`` at stages 1-2, or use smaller fetch units at stage 3, for a finer split).
Every rank cuts at the same place: shards of a bucket have one size on every rank.

The optimizer is the one a full offload builds (ds_strategy's kernel optimizers, ``CPUAdam`` and siblings,
or a client optimizer's kernel twin), and one instance steps both halves: its kernels bucket the masters
by device and run per device (the CUDA Adam kernel for device masters, the OpenMP + SIMD one for host
masters; Adagrad's and Lion's pure-torch twins on CUDA): the "same optimizer function" on both sides, as
DeepSpeed's. Its state is per master, on the master's device. A checkpoint saves each param group's state
as one flat partition whatever the ratio, so the format does not depend on it, and a load places every
value on its master's device (torch's ``Optimizer.load_state_dict``): a checkpoint saved at one ratio
resumes at any other, or with no offload.

The step (``OptimizerStep.apply``, step.py): the device masters read the reduced gradients where they are;
the host masters get fp32 copies, all issued first (on CUDA on the side stream, ``offload_copy.py``). The
device masters' tiles are stepped first (on CUDA: launched on the compute stream, asynchronous), then the
host tiles, each as soon as its copies have landed, while the device works; the publish (updated 16-bit
values copied back, then the all-gather, on the compute stream) joins the two. On a CPU-only run the
"device" is the CPU too: nothing moves, and the split is bookkeeping (which masters count as offloaded);
the device-strict test mode (``DS_STRATEGY_DEVICE_STRICT=1``), whose compute device is ``cpu:0``, moves them
as a GPU run does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ds_strategy.log import get_logger

from .buffers import GroupStorage
from .offload import HOST, Offload

log = get_logger(__name__)

# A group's host share may exceed ``ratio`` by this much before rank 0 warns that the buckets are too coarse.
COARSE_SPLIT = 0.05


def host_count(numels: Sequence[int], ratio: float) -> int:
    """How many leading masters (of ``numels`` elements each, in partition order) stay on the host: the device
    takes trailing masters while their elements stay within ``1 - ratio`` of the total (the host keeps at
    least ``ratio``; see [Note: the partial offload split])."""
    total = sum(numels)
    budget = total - math.ceil(ratio * total - 1e-9)  # elements the device may keep
    n, on_device = len(numels), 0
    while n > 0 and on_device + numels[n - 1] <= budget:
        n -= 1
        on_device += numels[n]
    return n


@dataclass
class MasterSplit:
    """Where each param group's masters live under a partial offload (see the note)."""

    ratio: float
    host_counts: list[int]  # per group: its leading masters that stay on the host
    host: set[nn.Parameter] = field(default_factory=set)  # those masters (a parameter hashes by identity)
    device_buffers: list[torch.Tensor] = field(default_factory=list)  # fp32 storage of the masters moved

    @classmethod
    def place(
        cls, groups: Sequence[GroupStorage], offload: Offload, device: torch.device, *, rank: int = 0
    ) -> MasterSplit | None:
        """Cut every group's masters (built on the host) and move the device part to ``device``; None without a
        partial offload."""
        if not offload.partial:
            return None
        split = cls(offload.ratio, [])
        for gs in groups:
            numels = [m.numel() for m in gs.masters]
            n = host_count(numels, offload.ratio)
            split.host_counts.append(n)
            split.host.update(gs.masters[:n])
            # Masters that are not a separate buffer (the compute device is the host) stay where they are.
            if device != HOST and gs.master_flat is not None and n < len(gs.masters):
                split.device_buffers.append(_move(gs, n, device, pin=offload.pin_masters(device)))
        if rank == 0:
            split.log_shares(groups)
        return split

    def device_master_bytes(self) -> int:
        """Bytes of the fp32 masters moved to the compute device (a stage's ``master`` bytes beside its host ones)."""
        return sum(b.numel() * b.element_size() for b in self.device_buffers)

    def sides(self, g: int, count: int) -> list[tuple[int, int, bool]]:
        """``(start, end, on the host)`` ranges of group ``g``'s ``count`` masters: host part first, no empty one."""
        n = self.host_counts[g]
        return [(lo, hi, lo == 0) for lo, hi in ((0, n), (n, count)) if hi > lo]

    def share(self, g: int, gs: GroupStorage) -> float:
        """The share of group ``g``'s partition elements whose masters are on the host."""
        total = sum(m.numel() for m in gs.masters)
        return sum(m.numel() for m in gs.masters[: self.host_counts[g]]) / total if total else 1.0

    def log_shares(self, groups: Sequence[GroupStorage]) -> None:
        parts = []
        for g, gs in enumerate(groups):
            if not gs.masters:
                continue
            share = self.share(g, gs)
            parts.append(f"group {g}: {share:.1%} ({self.host_counts[g]} of {len(gs.masters)} buckets)")
            if share > self.ratio + COARSE_SPLIT:
                log.warning(
                    "offload_optimizer.ratio %s: param group %d keeps %.1f%% of its masters on the host (%d of %d "
                    "buckets); the split falls between buckets, so lower reduce_bucket_size (stages 1-2) or use "
                    "smaller fetch units (stage 3) for a split closer to the ratio",
                    self.ratio,
                    g,
                    100 * share,
                    self.host_counts[g],
                    len(gs.masters),
                )
        log.info("partial optimizer offload (ratio %s), on the host: %s", self.ratio, "; ".join(parts))


@torch.no_grad()
def _move(gs: GroupStorage, n: int, device: torch.device, *, pin: bool) -> torch.Tensor:
    """Re-home ``gs``'s masters: the first ``n`` into a host buffer of their own (the group's ``master_flat``
    from now on), the others into one fp32 buffer on ``device``, which is returned."""
    host, moved = gs.masters[:n], gs.masters[n:]
    host_buf = torch.empty(sum(m.numel() for m in host), dtype=torch.float32, device=HOST, pin_memory=pin)
    device_buf = torch.empty(sum(m.numel() for m in moved), dtype=torch.float32, device=device)
    for buf, masters in ((host_buf, host), (device_buf, moved)):
        at = 0
        for m in masters:
            view = buf[at : at + m.numel()].view_as(m)
            view.copy_(m.detach())
            m.data = view
            at += m.numel()
    gs.master_flat = host_buf  # the full-size host buffer goes: the device part's host copy is freed
    return device_buf


def host_masters(groups: Iterable[GroupStorage], offload: Offload, split: MasterSplit | None) -> set[nn.Parameter]:
    """The masters held in host memory: none without optimizer offload, all with a full one, the split's
    host part with a partial one."""
    if not offload.optimizer:
        return set()
    if split is not None:
        return set(split.host)
    return {m for gs in groups for m in gs.masters}


def split_by_device(
    breakdown: Mapping[str, int],
    groups: Sequence[GroupStorage],
    optimizer: torch.optim.Optimizer | None,
    *,
    offload: Offload,
    split: MasterSplit | None,
    host_grad_bytes: int,
    host_param_bytes: int,
) -> dict[str, int]:
    """``breakdown`` (``engine.memory_breakdown()``) with each kind ``k`` cut into ``k`` (compute device) and
    ``k_host`` (host memory): the masters and optimizer state of the offloaded masters (all of them with a full
    offload, the split's host part with a partial one), the gradients' host copies (``host_grad_bytes``), and
    stage 3's offloaded parameter partitions (``host_param_bytes``). The values sum to ``breakdown``'s. On a
    CPU-only run the host part is bookkeeping: what a GPU run would keep in host memory."""
    on_host = host_masters(groups, offload, split)
    master = sum(
        m.numel() * m.element_size()
        for gs in groups
        if gs.master_flat is not None and not gs.aliased
        for m in gs.masters
        if m in on_host
    )
    state = 0
    if optimizer is not None:
        for m in on_host:
            values: dict[str, Any] = optimizer.state.get(m, {})
            state += sum(t.numel() * t.element_size() for t in values.values() if isinstance(t, torch.Tensor))
    host = {"params": host_param_bytes, "grads": host_grad_bytes, "master": master, "optimizer_state": state}
    out: dict[str, int] = {}
    for key, value in breakdown.items():
        moved = min(host.get(key, 0), value)
        out[key] = value - moved
        if key in host:
            out[f"{key}_host"] = moved
    return out
