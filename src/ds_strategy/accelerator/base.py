"""The accelerator interface: one small immutable object per device kind (cuda | cpu | mps).

An accelerator answers "which device, which collective backend, how much memory" without any caller
branching on the device kind. Objects hold no state (every query asks torch or the OS at call time), so
one shared instance per kind is safe across threads and forked workers.

[Note: never initialise CUDA early]
Forked workers (Lightning's notebook launcher, DataLoader workers) cannot use CUDA once the parent has
initialised it. Nothing here touches CUDA at import or construction time, and the queries used for
detection (``torch.cuda.device_count``) go through NVML, which does not create a CUDA context. Methods
such as ``current_device`` or ``synchronize`` do initialise CUDA when called, as torch's own would.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MemoryStats:
    """A memory snapshot. ``kind="device"``: bytes held by torch's allocator on ``device``;
    ``kind="process"``: the process's resident set (RSS) on the host. ``peak`` is None where the platform
    keeps no high-water mark; ``reserved`` is the device allocator's cached total (None on CPU)."""

    kind: Literal["device", "process"]
    device: str
    allocated: int
    peak: int | None
    reserved: int | None = None

    def describe(self) -> str:
        def mib(n: int | None) -> str:
            return "n/a" if n is None else f"{n / 2**20:.1f} MiB"

        what = "allocated" if self.kind == "device" else "RSS"
        text = f"{self.device}: {what} {mib(self.allocated)}, peak {mib(self.peak)}"
        return text if self.reserved is None else f"{text}, reserved {mib(self.reserved)}"


@dataclass(frozen=True)
class Accelerator(ABC):
    """Device kind, collective backend, memory statistics, synchronisation and seeding for one device kind.

    Subclasses set ``device_type`` and ``backend``; ``device_index=None`` means the current device.
    """

    device_type: ClassVar[str]
    backend: ClassVar[str]

    # ---- identity --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.device_type

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` or ``"cuda:1"``: a string torch accepts as a device."""
        return self.device_type if device_index is None else f"{self.device_type}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        import torch

        return torch.device(self.device_type) if device_index is None else torch.device(self.device_type, device_index)

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for tensors on this device: ``"nccl"`` or ``"gloo"``."""
        return self.backend

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.device_type

    # ---- devices ---------------------------------------------------------------------------------
    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def current_device(self) -> int: ...

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` current (a no-op for kinds with one device)."""
        return None

    @abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all queued work on the device to finish."""

    # ---- randomness ------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed the CPU generator and every device of this kind (lazily, without initialising CUDA)."""
        import torch

        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        import torch

        return int(torch.initial_seed())

    # ---- memory ----------------------------------------------------------------------------------
    @abstractmethod
    def memory_stats(self, device_index: int | None = None) -> MemoryStats: ...

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self.memory_stats(device_index).allocated

    def max_memory_allocated(self, device_index: int | None = None) -> int | None:
        return self.memory_stats(device_index).peak

    @abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> bool:
        """Restart the high-water mark from the current usage; False where the platform cannot."""

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver (no-op where there is no cache)."""
        return None

    # ---- host memory -----------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of a CPU ``tensor`` for fast asynchronous copies to this device.

        Kinds without asynchronous host-to-device copies (cpu, mps) return ``tensor`` itself, so callers
        can pin unconditionally.
        """
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    # ---- numerics --------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"{type(self).__name__}(device_type={self.device_type!r}, backend={self.backend!r})"
