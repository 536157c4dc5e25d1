"""``zero.Init``: build a model with every parameter partitioned as soon as its module is constructed.

[Note: partition on construction]
Inside ``with ds_strategy.zero.Init():`` modules are built normally, on the real device, with the normal
random initialisation (so the random stream advances exactly as in a plain build). Two global module
hooks of torch (``register_module_parameter_registration_hook`` and
``register_module_module_registration_hook``; no tensor constructor is patched) tell us when parameters
appear and when modules are attached to their parents. At each such event every module seen so far whose
``__init__`` is no longer running (checked on the Python call stack) has its parameters partitioned:
rank 0's values are broadcast, each rank keeps its contiguous 1/W piece of the flattened parameter and
``param.data`` becomes a 0-element placeholder. So at any moment only the modules still under
construction are whole: peak memory is about the largest leaf module, not the model.

The values equal those of a plain build on rank 0 with the same seed, *provided a module's parameters
are final when its ``__init__`` returns* (true for torch's layers and ``reset_parameters``). Code that
re-initialises a submodule's parameters afterwards (``self.apply(self._init_weights)`` at the end of the
root's ``__init__``) sees placeholders and must wrap the edit in
``GatheredParameters(params, modifier_rank=0)`` - the same rule as DeepSpeed's ``zero.Init``.

The per-parameter pieces are converted into the engine's bucketed layout when the stage-3 engine is
built (bucket by bucket, gathering only one parameter at a time). Buffers are never partitioned.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.hooks import RemovableHandle

from ds_strategy.accelerator import get_accelerator

from .collectives import Collectives

_ATTR = "_ds_init_shard"


@dataclass
class InitShard:
    """This rank's piece of a parameter partitioned by ``zero.Init``."""

    shape: torch.Size
    numel: int
    shard: torch.Tensor  # ceil(numel / W) elements of the flattened parameter, zero-padded at the end
    coll: Collectives


def init_shard(param: torch.Tensor) -> InitShard | None:
    return getattr(param, _ATTR, None)


def compute_device() -> torch.device:
    """This rank's compute device (``cuda:N``, ``cpu``; ``cpu:0`` under the device-strict mode)."""
    return torch.device(get_accelerator().current_device_name())


@torch.no_grad()
def partition_param(param: nn.Parameter, coll: Collectives, *, src: int = 0) -> None:
    """Broadcast rank ``src``'s value, keep this rank's piece, leave a placeholder in ``param.data``."""
    if init_shard(param) is not None:
        return
    # A module built on the host is moved to the compute device one parameter at a time: NCCL broadcasts
    # nothing else, and the shard then lives where the engine will train it.
    full = param.detach().to(compute_device()).contiguous().view(-1)
    coll.broadcast(full, src=src)
    keep_shard(param, full, coll)


@torch.no_grad()
def keep_shard(param: nn.Parameter, full: torch.Tensor, coll: Collectives) -> None:
    """Keep this rank's piece of ``full`` (``param``'s flattened value, the same on every rank) as its
    zero.Init shard, on ``full``'s device, and leave a placeholder in ``param.data``."""
    numel, world = full.numel(), coll.world_size
    per = -(-numel // world) if numel else 0
    shard = torch.zeros(per, dtype=full.dtype, device=full.device)
    lo, hi = min(coll.rank * per, numel), min((coll.rank + 1) * per, numel)
    shard[: hi - lo].copy_(full[lo:hi])
    setattr(param, _ATTR, InitShard(param.shape, numel, shard, coll))
    param.data = torch.empty(0, dtype=full.dtype, device=full.device)


@torch.no_grad()
def gather_init_param(param: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full flattened value of a ``zero.Init`` parameter (a collective: every rank calls it); ``out``:
    a scratch buffer of the shard's dtype and device with room for every rank's shard, reused by callers
    that gather many parameters in turn."""
    info = init_shard(param)
    if info is None:
        raise ValueError("gather_init_param: the parameter was not partitioned by zero.Init")
    total = info.shard.numel() * info.coll.world_size
    if out is None or out.numel() < total or out.dtype != info.shard.dtype or out.device != info.shard.device:
        out = torch.empty(total, dtype=info.shard.dtype, device=info.shard.device)
    out = out[:total]
    info.coll.all_gather(out, info.shard)
    return out[: info.numel]


def release_init_shard(param: torch.Tensor) -> None:
    """Forget zero.Init's shard of ``param`` once a stage-3 engine has taken it into its partition."""
    if init_shard(param) is not None:
        delattr(param, _ATTR)


@torch.no_grad()
def unpartition_param(param: nn.Parameter) -> None:
    """Make a ``zero.Init`` parameter whole again on every rank (a collective)."""
    info = init_shard(param)
    if info is None:
        return
    param.data = gather_init_param(param).clone().view(info.shape)
    delattr(param, _ATTR)


class Init:
    """Context manager: modules built inside have their parameters partitioned across the data-parallel
    ranks (see [Note: partition on construction]). Accepts DeepSpeed's arguments; ``module=`` partitions
    an already built module instead. Needs torch.distributed (initialised here if it is not yet)."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **_ignored: Any,
    ) -> None:
        self.enabled = enabled
        self.group = data_parallel_group
        self.dtype = dtype
        self._coll: Collectives | None = None
        self._pending: list[nn.Module] = []
        self._handles: list[RemovableHandle] = []
        self.peak_whole_bytes = 0  # the most bytes of not-yet-partitioned parameters seen at an event
        if module is not None and enabled:
            for p in module.parameters():
                self._partition(p)

    @property
    def coll(self) -> Collectives:
        if self._coll is None:
            if not dist.is_initialized():
                from ds_strategy.comm import init_distributed

                init_distributed()
            # Construction moves each tensor once (a broadcast): no shared-memory segment per Init context.
            self._coll = Collectives(self.group, fast_path=False)
        return self._coll

    def __enter__(self) -> Init:
        if self.enabled:
            _ = self.coll
            self._handles = [
                module_mod.register_module_parameter_registration_hook(self._on_param),
                module_mod.register_module_module_registration_hook(self._on_module),
            ]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if exc_type is None and self.enabled:
            self._flush(force=True)
        self._pending = []

    # ------------------------------------------------------------------ hooks
    def _on_param(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        self._flush()
        if param is not None and init_shard(param) is None and not any(m is module for m in self._pending):
            self._pending.append(module)

    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        self._flush()

    def _flush(self, *, force: bool = False) -> None:
        """Partition the parameters of every pending module whose ``__init__`` has returned."""
        if not self._pending:
            return
        self.peak_whole_bytes = max(self.peak_whole_bytes, self._whole_bytes())
        building = set() if force else _modules_under_construction()
        keep = []
        for m in self._pending:
            if id(m) in building:
                keep.append(m)
                continue
            for p in m._parameters.values():
                if p is not None:
                    self._partition(p)
        self._pending = keep

    def _partition(self, p: nn.Parameter) -> None:
        if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
            p.data = p.data.to(self.dtype)
        partition_param(p, self.coll)

    def _whole_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size()
            for m in self._pending
            for p in m._parameters.values()
            if p is not None and init_shard(p) is None
        )


def _modules_under_construction() -> set[int]:
    """ids of the modules whose ``__init__`` is on the Python call stack right now."""
    out: set[int] = set()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module):
                out.add(id(obj))
        frame = frame.f_back  # type: ignore[assignment]
    return out
