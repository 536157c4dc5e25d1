"""``Offload``: what ZeRO keeps on the host or on NVMe, read once from ``zero_optimization``'s offload
blocks and the ``aio`` block.

The engine builds one and hands it to the stage (``StageOptions.offload``) and to the optimizer set-up;
nothing else looks at the offload keys. NVMe offload is host offload whose bytes rest in swap files
(``runtime/swap``): ``optimizer`` / ``params`` are true for it too, and ``optimizer_nvme`` /
``params_nvme`` say where the files go and how they are buffered. ``ratio`` below 1 is ZeRO-Offload++'s
partial offload: that share of the masters stays on the host, the rest goes back to the compute device
once the stage has built them (``runtime/zero/partial_offload.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ds_strategy.ops.aio import AioOptions

HOST = torch.device("cpu")


@dataclass(frozen=True)
class NvmeSwap:
    """One offload block's NVMe settings (DeepSpeed's keys)."""

    path: str
    buffer_count: int
    buffer_size: int = 0  # offload_param: elements per read-ahead buffer
    max_in_cpu: int = 0  # offload_param: partition elements kept in host memory instead
    pipeline_read: bool = False  # offload_optimizer
    pipeline_write: bool = False  # offload_optimizer

    @classmethod
    def from_block(cls, block: Any) -> NvmeSwap | None:
        if block.device != "nvme":
            return None
        return cls(
            path=str(block.nvme_path),
            buffer_count=int(block.buffer_count),
            buffer_size=int(block.buffer_size),
            max_in_cpu=int(block.max_in_cpu),
            pipeline_read=bool(block.pipeline_read),
            pipeline_write=bool(block.pipeline_write),
        )


@dataclass(frozen=True)
class Offload:
    optimizer: bool = False  # offload_optimizer.device "cpu"/"nvme": fp32 masters and optimizer state on the host
    params: bool = False  # offload_param.device "cpu"/"nvme" (stage 3): the compute-dtype partition on the host
    pin_optimizer: bool = False  # offload_optimizer.pin_memory
    pin_params: bool = False  # offload_param.pin_memory
    optimizer_nvme: NvmeSwap | None = None  # ... resting in swap files between steps
    params_nvme: NvmeSwap | None = None  # ... resting in swap files between gathers
    aio: AioOptions = field(default_factory=AioOptions)
    ratio: float = 1.0  # offload_optimizer.ratio: the share of the masters and optimizer state on the host

    @property
    def partial(self) -> bool:
        """A partial optimizer offload: part of the masters on the host, the rest on the compute device."""
        return self.optimizer and self.ratio < 1.0

    @classmethod
    def from_config(cls, zero: Any, aio: Any = None) -> Offload:
        """From a ``ZeroConfig`` (offload_param is stage 3's alone; the config checks refuse it elsewhere) and
        the ``aio`` block."""
        return cls(
            optimizer=zero.offload_optimizer.device in ("cpu", "nvme"),
            params=zero.offload_param.device in ("cpu", "nvme"),
            pin_optimizer=bool(zero.offload_optimizer.pin_memory),
            pin_params=bool(zero.offload_param.pin_memory),
            optimizer_nvme=NvmeSwap.from_block(zero.offload_optimizer),
            params_nvme=NvmeSwap.from_block(zero.offload_param),
            aio=AioOptions.from_config(_aio_block(aio)),
            ratio=float(zero.offload_optimizer.ratio),
        )

    def master_device(self, compute: torch.device) -> torch.device:
        return HOST if self.optimizer else compute

    def param_device(self, compute: torch.device) -> torch.device:
        return HOST if self.params else compute

    # Page-locked host memory speeds up copies to and from a CUDA device; with a CPU compute device there
    # is nothing to copy, so the key is read but changes nothing.
    def pin_masters(self, compute: torch.device) -> bool:
        return self.optimizer and self.pin_optimizer and compute.type == "cuda"

    def pin_partition(self, compute: torch.device) -> bool:
        return self.params and self.pin_params and compute.type == "cuda"


def _aio_block(aio: Any) -> dict[str, Any] | None:
    """The ``aio`` config block as AioOptions reads it (``intra_op_parallelism`` wins over ``thread_count``)."""
    if aio is None:
        return None
    return {
        "block_size": aio.block_size,
        "queue_depth": aio.queue_depth,
        "thread_count": aio.threads,
        "single_submit": aio.single_submit,
        "overlap_events": aio.overlap_events,
    }
