"""The Apple MPS accelerator: gloo collectives (MPS has no collective backend), MPS allocator statistics."""

from __future__ import annotations

from dataclasses import dataclass

from ds_strategy.accelerator.base import Accelerator, MemoryStats


@dataclass(frozen=True)
class MpsAccelerator(Accelerator):
    """Apple-silicon GPU through Metal Performance Shaders (one device)."""

    device_type = "mps"
    backend = "gloo"

    def is_available(self) -> bool:
        import torch

        return bool(torch.backends.mps.is_available())

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def current_device(self) -> int:
        return 0

    def synchronize(self, device_index: int | None = None) -> None:
        import torch

        torch.mps.synchronize()

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        torch.mps.manual_seed(seed)

    def memory_stats(self, device_index: int | None = None) -> MemoryStats:
        import torch

        # The MPS allocator keeps no high-water mark.
        return MemoryStats(
            kind="device",
            device="mps",
            allocated=int(torch.mps.current_allocated_memory()),
            peak=None,
            reserved=int(torch.mps.driver_allocated_memory()),
        )

    def reset_peak_memory_stats(self, device_index: int | None = None) -> bool:
        return False

    def empty_cache(self) -> None:
        import torch

        torch.mps.empty_cache()

    def is_bf16_supported(self) -> bool:
        return True
