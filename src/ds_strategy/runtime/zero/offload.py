"""``Offload``: what ZeRO keeps on the host, read once from ``zero_optimization``'s offload blocks.

The engine builds one and hands it to the stage (``StageOptions.offload``) and to the optimizer set-up;
nothing else looks at the offload keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

HOST = torch.device("cpu")


@dataclass(frozen=True)
class Offload:
    optimizer: bool = False  # offload_optimizer.device "cpu": fp32 masters and optimizer state on the host
    params: bool = False  # offload_param.device "cpu" (stage 3): the compute-dtype partition on the host
    pin_optimizer: bool = False  # offload_optimizer.pin_memory
    pin_params: bool = False  # offload_param.pin_memory

    @classmethod
    def from_config(cls, zero: Any) -> Offload:
        """From a ``ZeroConfig`` (offload_param is stage 3's alone; the config checks refuse it elsewhere)."""
        return cls(
            optimizer=zero.offload_optimizer.device == "cpu",
            params=zero.offload_param.device == "cpu",
            pin_optimizer=bool(zero.offload_optimizer.pin_memory),
            pin_params=bool(zero.offload_param.pin_memory),
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
