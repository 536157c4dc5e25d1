"""NVMe offload (ZeRO-Infinity): what ZeRO offloads to the host, resting in swap files between uses.

``files`` makes the owner-only swap directory and aligned file regions; ``optimizer`` swaps masters,
optimizer state and gradients a sub-group at a time around the step; ``params`` swaps stage 3's parameter
partitions around their gathers. All I/O goes through ``ds_strategy.ops.aio``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ds_strategy.ops.aio import AsyncIO

from ..host_memory import return_freed_memory_to_os
from .files import NvmePathError, SwapDir, SwapFile
from .optimizer import OptimizerSwapper
from .params import PartitionSwapper


class Offload(Protocol):
    """What the swappers need of ZeRO's offload settings (``runtime/zero/offload.py``'s ``Offload``): the NVMe
    blocks (``path``, ``buffer_count``, ``buffer_size``, ``pipeline_read``, ``pipeline_write``) and the aio
    options. A protocol, so that swap/ stays below zero/."""

    @property
    def optimizer_nvme(self) -> Any: ...
    @property
    def params_nvme(self) -> Any: ...
    @property
    def aio(self) -> Any: ...


# [Note: host memory under NVMe offload]
# NVMe offload exists to keep host memory independent of the model's size, and glibc's malloc defeats that
# by itself: freed multi-MiB blocks (a whole parameter under construction, a gradient shard written out)
# stay in its heap, and the heap's high-water mark grows with the model (measured: a 4x deeper GPT's
# peak RSS 1.6x the base model's, from construction on; malloc_trim gave back 200 MB of it). So an engine
# or zero.Init with NVMe offload pins glibc's mmap/trim thresholds at 8 MiB for the process
# (``host_memory.return_freed_memory_to_os``, unless the user set MALLOC_MMAP_THRESHOLD_ /
# MALLOC_TRIM_THRESHOLD_) and trims the heap (``host_memory.trim_heap``) after each zero.Init partition
# event, after the engine is built, before and after each optimizer step and, when the model computes on
# the host, after each bucket's gradient shard lands in backward (the backward frees activations and
# gradients in an order that leaves the heap's free pages scattered: measured on bench_nvme's 8-layer GPT,
# the backward's peak RSS ~20 MiB lower per rank): a few milliseconds each, small beside the disk transfers.


__all__ = ["NvmePathError", "OptimizerSwapper", "PartitionSwapper", "Swap", "make_swap"]


class Swap:
    """The swappers of one engine, their I/O engines and directories; ``close`` removes the files."""

    def __init__(self) -> None:
        self.optimizer: OptimizerSwapper | None = None
        self.params: PartitionSwapper | None = None
        self._dirs: list[SwapDir] = []
        self._engines: list[AsyncIO] = []
        self._files: list[SwapFile] = []

    def _file(self, offload: Offload, path: str, rank: int, key: str, need: int, name: str) -> SwapFile:
        directory = SwapDir(path, rank, key=key, need_bytes=need)
        engine = AsyncIO(offload.aio)
        file = SwapFile(engine, directory.path / name)
        self._dirs.append(directory)
        self._engines.append(engine)
        self._files.append(file)
        return file

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.flush()
        if self.params is not None:
            self.params.close()
        for file in self._files:
            file.close()
        for engine in self._engines:
            engine.close()
        for directory in self._dirs:
            directory.remove()
        self._files, self._engines, self._dirs = [], [], []

    @property
    def directories(self) -> list[str]:
        return [str(d.path) for d in self._dirs]


def make_swap(
    offload: Offload, *, rank: int, stage: int, partition_numel: int, compute_dtype: torch.dtype
) -> Swap | None:
    """The swappers ``offload`` asks for (None when nothing goes to NVMe). ``partition_numel``: this rank's
    share of the trainable elements, to check the disk has room before anything is written."""
    if offload.optimizer_nvme is None and offload.params_nvme is None:
        return None
    return_freed_memory_to_os()  # see [Note: host memory under NVMe offload]
    swap = Swap()
    opt = offload.optimizer_nvme
    if opt is not None:
        # fp32 master + two Adam moments (+ stage 3's gradient): what the files will hold after one step.
        need = partition_numel * 4 * (4 if stage == 3 else 3)
        file = swap._file(offload, opt.path, rank, "offload_optimizer", need, "optimizer.swp")
        swap.optimizer = OptimizerSwapper(
            file,
            buffer_count=opt.buffer_count,
            pipeline_read=opt.pipeline_read,
            pipeline_write=opt.pipeline_write,
            report=rank == 0,
        )
    par = offload.params_nvme
    if par is not None:
        need = partition_numel * compute_dtype.itemsize
        file = swap._file(offload, par.path, rank, "offload_param", need, "params.swp")
        swap.params = PartitionSwapper(
            file, dtype=compute_dtype, buffer_count=par.buffer_count, buffer_numel=par.buffer_size
        )
    return swap
