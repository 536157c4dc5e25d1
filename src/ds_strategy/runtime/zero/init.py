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

The values equal those of a plain build on rank 0 with the same seed. Code that re-initialises a
submodule's parameters afterwards (``self.apply(self._init_weights)`` at the end of the root's
``__init__``, peft's adapters) does so through ``torch.nn.init``, which is made to work on partitioned
parameters ([Note: init functions on partitioned parameters]); other writes to a parameter built earlier
(``p.data.copy_(...)``) see a placeholder and must be wrapped in
``GatheredParameters(params, modifier_rank=0)`` - the same rule as DeepSpeed's ``zero.Init``.

[Note: meta parameters under zero.Init]
``transformers``' ``from_pretrained`` builds the model on the meta device (no storage) and then assigns each
loaded tensor as a new ``nn.Parameter`` (``setattr``, which fires the registration hook). A meta parameter
has nothing to partition, so it is left as it is; the real one that replaces it is partitioned as soon as
it is registered. So ``from_pretrained`` inside ``zero.Init`` (``LightningModule.configure_model`` under
stage 3) ends with every loaded weight partitioned, and no rank holds more than a few whole tensors at once
(each rank still reads every tensor from the file: ``ds_strategy.utils.load_hf_weights`` into a model built
with ``from_config`` reads only this rank's slices). A parameter still on the meta device when the engine is
built is refused there, naming it.

The per-parameter pieces are converted into the engine's bucketed layout when the stage-3 engine is
built (bucket by bucket, gathering only one parameter at a time). Buffers are never partitioned.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.hooks import RemovableHandle

from ds_strategy.accelerator import get_accelerator

from ..packed import is_packed
from .collectives import Collectives

_ATTR = "_ds_init_shard"


@dataclass
class InitShard:
    """This rank's piece of a parameter partitioned by ``zero.Init``: ``per`` = ceil(numel / W) elements of
    the flattened parameter, zero-padded at the end, in ``shard`` - or, with ``remote_device="nvme"``, in a
    swap file (``store``; ``shard`` is then a 0-element placeholder of the piece's dtype)."""

    shape: torch.Size
    numel: int
    shard: torch.Tensor
    coll: Collectives
    per: int = -1
    store: InitStore | None = None
    key: int = -1  # its region in ``store``

    def __post_init__(self) -> None:
        if self.per < 0:
            self.per = self.shard.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def values(self) -> torch.Tensor:
        """The piece's elements (read from the swap file when it rests there)."""
        if self.store is None:
            return self.shard
        return self.store.read(self)

    def write_prefix(self, values: torch.Tensor) -> None:
        """Set the piece's first ``len(values)`` elements."""
        if self.store is None:
            self.shard[: values.numel()].copy_(values)
            return
        piece = self.store.read(self)
        piece[: values.numel()].copy_(values)
        self.store.write(self, piece)


class InitStore:
    """``zero.Init(remote_device="nvme")``: every shard of one Init context in one swap file of this rank
    under ``offload_param.nvme_path``; the file goes when the engine has taken the last shard (or at exit)."""

    def __init__(self, nvme_path: str, aio: Any, rank: int) -> None:
        from ds_strategy.ops.aio import AsyncIO

        from ..host_memory import return_freed_memory_to_os
        from ..swap.files import SwapDir, SwapFile
        from .offload import AioOptions, _aio_block

        return_freed_memory_to_os()  # [Note: host memory under NVMe offload] in runtime/swap/__init__.py
        self.dir = SwapDir(nvme_path, rank, key="offload_param", need_bytes=0)
        self.aio = AsyncIO(AioOptions.from_config(_aio_block(aio)))
        self.file = SwapFile(self.aio, self.dir.path / "init.swp")
        self.live: set[int] = set()
        self._next = 0

    def write(self, info: InitShard, piece: torch.Tensor) -> None:
        if info.key < 0:
            info.key = self._next
            self._next += 1
            self.live.add(info.key)
        self.file.write(info.key, piece.detach().to("cpu").contiguous()).wait()

    def read(self, info: InitShard) -> torch.Tensor:
        out = torch.empty(info.per, dtype=info.dtype)
        self.file.read(info.key, out).wait()
        return out.to(info.shard.device)

    def forget(self, info: InitShard) -> None:
        self.live.discard(info.key)
        if not self.live:
            self.file.close()
            self.aio.close()
            self.dir.remove()


def init_shard(param: torch.Tensor) -> InitShard | None:
    return getattr(param, _ATTR, None)


def compute_device() -> torch.device:
    """This rank's compute device (``cuda:N``, ``cpu``; ``cpu:0`` under the device-strict mode)."""
    return torch.device(get_accelerator().current_device_name())


@torch.no_grad()
def partition_param(param: nn.Parameter, coll: Collectives, *, src: int = 0, store: InitStore | None = None) -> None:
    """Broadcast rank ``src``'s value, keep this rank's piece, leave a placeholder in ``param.data``."""
    if init_shard(param) is not None:
        return
    # A module built on the host is moved to the compute device one parameter at a time: NCCL broadcasts
    # nothing else, and the shard then lives where the engine will train it.
    full = param.detach().to(compute_device()).contiguous().view(-1)
    coll.broadcast(full, src=src)
    keep_shard(param, full, coll, store=store)


@torch.no_grad()
def keep_shard(
    param: nn.Parameter,
    full: torch.Tensor,
    coll: Collectives,
    shape: torch.Size | None = None,
    store: InitStore | None = None,
) -> None:
    """Keep this rank's piece of ``full`` (``param``'s flattened value, the same on every rank) as its
    zero.Init shard, on ``full``'s device (in ``store``'s swap file when given), and leave a placeholder in
    ``param.data``."""
    numel, world = full.numel(), coll.world_size
    per = -(-numel // world) if numel else 0
    shard = torch.zeros(per, dtype=full.dtype, device=full.device)
    lo, hi = min(coll.rank * per, numel), min((coll.rank + 1) * per, numel)
    shard[: hi - lo].copy_(full[lo:hi])
    placeholder = torch.empty(0, dtype=full.dtype, device=full.device)
    info = InitShard(param.shape if shape is None else shape, numel, placeholder if store else shard, coll, per, store)
    if store is not None:
        store.write(info, shard)
    setattr(param, _ATTR, info)
    mark_full_shape(param, info.shape)
    # 0 elements, the parameter's number of dimensions: code that sorts parameters by ``p.ndim`` before the
    # engine is built (weight decay for matrices only, in configure_optimizers) sees what a plain build has.
    param.data = placeholder.view((0,) * max(1, len(info.shape)))


def mark_full_shape(param: torch.Tensor, shape: Sequence[int]) -> None:
    """DeepSpeed's ``ds_shape`` / ``ds_numel`` on a partitioned parameter, whose ``shape`` is a 0-element
    placeholder's: the full shape and size, the attributes DeepSpeed code reads (``p.ds_numel if
    hasattr(p, "ds_numel") else p.numel()``)."""
    param.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
    param.ds_numel = math.prod(shape)  # type: ignore[attr-defined]


@torch.no_grad()
def gather_init_param(param: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full flattened value of a ``zero.Init`` parameter (a collective: every rank calls it); ``out``:
    a scratch buffer of the shard's dtype and device with room for every rank's shard, reused by callers
    that gather many parameters in turn."""
    info = init_shard(param)
    if info is None:
        raise ValueError("gather_init_param: the parameter was not partitioned by zero.Init")
    total = info.per * info.coll.world_size
    if out is None or out.numel() < total or out.dtype != info.dtype or out.device != info.shard.device:
        out = torch.empty(total, dtype=info.dtype, device=info.shard.device)
    out = out[:total]
    info.coll.all_gather(out, info.values())
    return out[: info.numel]


def release_init_shard(param: torch.Tensor) -> None:
    """Forget zero.Init's shard of ``param`` once a stage-3 engine has taken it into its partition."""
    info = init_shard(param)
    if info is not None:
        delattr(param, _ATTR)
        if info.store is not None:
            info.store.forget(info)


@torch.no_grad()
def unpartition_param(param: nn.Parameter) -> None:
    """Make a ``zero.Init`` parameter whole again on every rank (a collective)."""
    info = init_shard(param)
    if info is None:
        return
    param.data = gather_init_param(param).clone().view(info.shape)
    release_init_shard(param)


# [Note: init functions on partitioned parameters]
# A module's parameters are partitioned once its ``__init__`` returns, but some code initialises them later,
# from a parent's ``__init__``: Hugging Face's ``post_init()`` (``_init_weights`` over every module), peft's
# adapters (``nn.init.zeros_(lora_B.weight)`` after the layer is built). On a placeholder those calls would
# be no-ops (or fail: xavier needs two dimensions), leaving other values than a plain build. So while an
# ``Init`` context is open the ``torch.nn.init`` functions (and transformers' own copies of them, which it
# keeps so that its guards survive patching) are wrapped: on a zero.Init parameter the function runs on a
# whole temporary of the parameter's shape, rank 0's result is broadcast and each rank keeps its piece. The
# random stream advances as in a plain build, so the values again equal a plain build's on rank 0. Every
# rank runs the same construction code, so every rank makes the same calls (each one is a collective).
# Writes through ``param.data`` (``p.data.normal_()``) are not seen: use ``GatheredParameters`` for those.
_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
_patch_depth = 0
_originals: list[tuple[Any, str, Any]] = []  # (module or dict, name, original)


def _on_whole_value(fn: Any) -> Any:
    def init_function(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        info = init_shard(tensor)
        if info is None:
            return fn(tensor, *args, **kwargs)
        with torch.no_grad():
            full = torch.empty(info.shape, dtype=info.dtype, device=info.shard.device)
            fn(full, *args, **kwargs)
            flat = full.view(-1)
            info.coll.broadcast(flat, src=0)
            # This rank's piece, into the shard it already has (no second shard at the peak).
            per, rank = info.per, info.coll.rank
            lo, hi = min(rank * per, info.numel), min((rank + 1) * per, info.numel)
            info.write_prefix(flat[lo:hi])
        return tensor

    init_function.__wrapped__ = fn  # type: ignore[attr-defined]
    return init_function


def _patch_init_functions() -> None:
    global _patch_depth
    _patch_depth += 1
    if _patch_depth > 1:
        return
    targets: list[Any] = [torch.nn.init]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        targets.append(hf.TORCH_INIT_FUNCTIONS)
    for target in targets:
        for name in _INIT_FUNCTIONS:
            original = target.get(name) if isinstance(target, dict) else getattr(target, name, None)
            if original is None:
                continue
            _originals.append((target, name, original))
            if isinstance(target, dict):
                target[name] = _on_whole_value(original)
            else:
                setattr(target, name, _on_whole_value(original))


def _restore_init_functions() -> None:
    global _patch_depth
    _patch_depth -= 1
    if _patch_depth > 0:
        return
    for target, name, original in reversed(_originals):
        if isinstance(target, dict):
            target[name] = original
        else:
            setattr(target, name, original)
    _originals.clear()


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
        self._remote = _remote_device(remote_device, config_dict_or_path if config is None else config)
        self._store: InitStore | None = None
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
            _patch_init_functions()  # [Note: init functions on partitioned parameters]
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handles:
            _restore_init_functions()
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
        if self._store is not None:
            from ..host_memory import trim_heap

            trim_heap()  # [Note: host memory under NVMe offload] in runtime/swap/__init__.py

    def _partition(self, p: nn.Parameter) -> None:
        if p.is_meta:
            return  # [Note: meta parameters under zero.Init]
        if is_packed(p):  # bitsandbytes quantizes it after construction; the engine partitions it as bytes
            return  # ([Note: packed partitions] in packed_store.py): never cast, split or broadcast here
        if self.dtype is not None and p.is_floating_point() and p.dtype != self.dtype:
            p.data = p.data.to(self.dtype)
        if self._remote is not None and self._store is None:
            nvme_path, aio = self._remote
            self._store = InitStore(nvme_path, aio, self.coll.rank)
        partition_param(p, self.coll, store=self._store)

    def _whole_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size()
            for m in self._pending
            for p in m._parameters.values()
            if p is not None and init_shard(p) is None and not p.is_meta
        )


def _remote_device(remote_device: str | None, config: Any) -> tuple[str, Any] | None:
    """(nvme_path, aio block) when the shards go to NVMe: ``remote_device="nvme"``, or the config's
    ``offload_param.device`` "nvme" when ``remote_device`` is not given (DeepSpeed's rule). Other values
    keep the shards on the compute device."""
    if remote_device not in (None, "none", "cpu", "nvme") and not str(remote_device).startswith("cuda"):
        raise ValueError(f'zero.Init(remote_device={remote_device!r}): expected None, "cpu" or "nvme"')
    if remote_device == "cpu" and compute_device().type != "cpu":
        warnings.warn(
            'zero.Init(remote_device="cpu"): the shards stay on the compute device until the engine takes them '
            '(host-resident construction is not built); use remote_device="nvme" to keep them off the device',
            stacklevel=3,
        )
    if remote_device not in (None, "nvme") or (remote_device is None and config is None):
        return None
    parsed = None
    if config is not None:
        from ds_strategy.config import load_config

        parsed = config if hasattr(config, "zero_optimization") else load_config(config)
    param = parsed.zero_optimization.offload_param if parsed is not None else None
    if remote_device is None and (param is None or param.device != "nvme"):
        return None
    if param is None or not param.nvme_path:
        raise ValueError(
            'zero.Init(remote_device="nvme") needs the config (config_dict_or_path=) with '
            "zero_optimization.offload_param.nvme_path: where the shards' swap files go"
        )
    return str(param.nvme_path), parsed.aio  # type: ignore[union-attr]


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
