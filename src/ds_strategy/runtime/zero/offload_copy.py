"""Gradients of an offloaded optimizer, from the device to the host masters, overlapped with the host step.

With ``offload_optimizer`` the reduced gradient partition lives on the device and the fp32 masters on the
host. On CUDA the copies run on a side stream into the (pinned, when ``pin_memory`` is true) host buffers,
tile by tile (``sub_group_size``), so the copy of the next tile proceeds while the host optimizer steps the
current one; each tile waits only for its own copies. Elsewhere (CPU compute device) the copies are plain
and immediate, which is also what the CPU test suite checks the results of.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _nothing() -> None:
    return None


class HostCopier:
    """Issues device -> host copies; ``copy`` returns the function that waits for that batch of copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        """Copy every ``(host destination, device source)`` pair; call the result before reading them."""
        if self.stream is None or not pairs:
            for dst, src in pairs:
                dst.copy_(src)
            return _nothing
        # The gradients are final once the work queued so far on the compute stream is done.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # not reused by the allocator before this copy has read it
        done = torch.cuda.Event()
        done.record(self.stream)
        return done.synchronize
