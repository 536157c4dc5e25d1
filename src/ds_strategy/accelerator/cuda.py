"""The CUDA accelerator: nccl collectives, torch's caching-allocator statistics.

See [Note: never initialise CUDA early] in base.py: detection uses ``torch.cuda.device_count`` (NVML),
and every method that needs a CUDA context creates it only when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds_strategy.accelerator.base import Accelerator, MemoryStats

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CudaAccelerator(Accelerator):
    """NVIDIA (or ROCm, which torch exposes as "cuda") GPUs."""

    device_type = "cuda"
    backend = "nccl"

    def is_available(self) -> bool:
        return self.device_count() > 0

    def device_count(self) -> int:
        import torch

        return int(torch.cuda.device_count())

    def current_device(self) -> int:
        import torch

        return int(torch.cuda.current_device())

    def set_device(self, device_index: int) -> None:
        import torch

        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        import torch

        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)  # queued until CUDA initialises; does not initialise it

    def memory_stats(self, device_index: int | None = None) -> MemoryStats:
        import torch

        index = self.current_device() if device_index is None else device_index
        return MemoryStats(
            kind="device",
            device=self.device_name(index),
            allocated=int(torch.cuda.memory_allocated(index)),
            peak=int(torch.cuda.max_memory_allocated(index)),
            reserved=int(torch.cuda.memory_reserved(index)),
        )

    def reset_peak_memory_stats(self, device_index: int | None = None) -> bool:
        import torch

        torch.cuda.reset_peak_memory_stats(device_index)
        return True

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    def is_bf16_supported(self) -> bool:
        import torch

        return bool(torch.cuda.is_bf16_supported())
