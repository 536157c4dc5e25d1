"""The CPU accelerator: gloo collectives, process memory (RSS) as the memory statistic."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ds_strategy.accelerator import strict
from ds_strategy.accelerator.base import Accelerator, MemoryStats

if TYPE_CHECKING:
    import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def process_memory() -> tuple[int, int | None]:
    """(resident set size, peak resident set size) of this process in bytes.

    Linux: VmRSS and VmHWM from /proc/self/status. Elsewhere: psutil's RSS when installed and the
    getrusage high-water mark (KiB on Linux, bytes on macOS).
    """
    try:
        fields = dict(line.split(":", 1) for line in _STATUS.read_text().splitlines() if ":" in line)
        rss = _kib(fields["VmRSS"])
        return rss, max(rss, _kib(fields["VmHWM"]))  # the kernel syncs per-thread RSS counters lazily
    except (OSError, KeyError, ValueError):
        pass
    peak: int | None = None
    try:
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024
    except (ImportError, OSError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss), peak
    except ImportError:
        return (peak or 0), peak


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS: Linux >= 4.0 only."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kib(value: str) -> int:
    number, unit = value.split()
    if unit.lower() != "kb":
        raise ValueError(f"unexpected unit {unit!r} in /proc/self/status")
    return int(number) * 1024


@dataclass(frozen=True)
class CpuAccelerator(Accelerator):
    """Host execution. One "device"; memory statistics are the process's RSS and peak RSS."""

    device_type = "cpu"
    backend = "gloo"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return self.device_name()

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu:0" if strict.ACTIVE else "cpu"  # torch has no "cpu:N" devices worth naming

    def device(self, device_index: int | None = None) -> torch.device:
        """The compute device: ``cpu``, or ``cpu:0`` under the device-strict mode (see strict.py)."""
        return strict.device() if strict.ACTIVE else super().device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        return None  # CPU kernels complete before returning

    def memory_stats(self, device_index: int | None = None) -> MemoryStats:
        rss, peak = process_memory()
        return MemoryStats(kind="process", device="cpu", allocated=rss, peak=peak)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> bool:
        return reset_peak_rss()

    def is_fp16_supported(self) -> bool:
        return True  # as a storage/communication format; compute upcasts
