"""Wall-clock timers for ``wall_clock_breakdown`` and the samples/s of the progress line."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ds_strategy.accelerator.spans import span


def _device_sync(device: torch.device) -> Callable[[], None] | None:
    """Kernels are asynchronous on accelerators: a timer must wait for them to mean anything."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


class Timers:
    """Named accumulating timers; disabled timers cost one attribute check."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self._sync = _device_sync(device)
        self._started: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            if self._sync is not None:
                self._sync()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._started:
            if self._sync is not None:
                self._sync()
            self._total[name] = self._total.get(name, 0.0) + time.perf_counter() - self._started.pop(name)
            self._count[name] = self._count.get(name, 0) + 1

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time ``name``; in a profiler trace the span is labelled ``ds::<name>``."""
        self.start(name)
        try:
            with span(f"ds::{name}"):
                yield
        finally:
            self.stop(name)

    def mean_ms(self, *, reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per call of every timer since the last reset."""
        out = {k: 1000.0 * v / max(1, self._count.get(k, 1)) for k, v in self._total.items()}
        if reset:
            self._total.clear()
            self._count.clear()
        return out


class Throughput:
    """Samples per second between two progress reports."""

    def __init__(self) -> None:
        self._t = time.perf_counter()
        self._samples = 0

    def rate(self, samples: int) -> float:
        now = time.perf_counter()
        value = (samples - self._samples) / max(now - self._t, 1e-9)
        self._t, self._samples = now, samples
        return value
