"""Stage 3's gather stream: on CUDA, a unit's copy-in and all-gather run beside the compute, ordered by events.

[Note: gather stream]
A gather is three pieces of device work: the copy of this rank's partition into its slot of the bucket,
the all-gather (NCCL runs it on its own stream, after the stream it was issued from), and - for ZeRO++ - the
quantization around it. Issued from the compute stream, the copy would sit in the compute stream's queue
behind the current unit's kernels, and a prefetch would gain nothing. So on CUDA they are issued from a
dedicated gather stream:

* the bucket's memory is allocated on the compute stream (the caching allocator then hands it out again
  only to work ordered after its last reader) and the gather stream first waits for everything enqueued on
  the compute stream so far (the previous users of the memory it is about to write): issued before the
  current unit's compute, a prefetch overlaps exactly that compute;
* an event recorded on the gather stream after the collective is what the compute stream waits on when the
  unit is used (``wait``): no host synchronisation anywhere;
* the bucket is freed on the compute stream after the kernels that read it were enqueued, so the memory is
  reused only after they ran.

Reduce-scatters run on NCCL's own stream, which waits for the gradients' copy into the staging bucket;
the compute stream waits for them only where the reduced shard is folded into the partition gradient.
On CPU (and for a gather issued with no stream) nothing changes: the background-thread collectives of
the shared-memory path overlap there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .collectives import Handle


class GatherStream:
    """The dedicated stream of one device's gathers (CUDA), or nothing (any other device)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and torch.cuda.is_available() else None
        # One event marks the compute stream's position for every gather: cudaStreamWaitEvent takes the
        # event's state when it is called, so re-recording it later changes no earlier wait (a fresh event
        # per gather, as Stream.wait_stream makes, costs the host an allocation and a create each time).
        self._mark = torch.cuda.Event() if self.stream is not None else None

    @contextmanager
    def issue(self) -> Iterator[None]:
        """Device work inside runs on the gather stream, after what the compute stream holds so far."""
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.stream.device)
        assert self._mark is not None
        self._mark.record(compute)
        self.stream.wait_event(self._mark)
        if torch.cuda.current_device() != self.stream.device_index:  # set_stream would switch the device
            with torch.cuda.stream(self.stream):
                yield
            return
        torch.cuda.set_stream(self.stream)  # what torch.cuda.stream() does, without its checks per call
        try:
            yield
        finally:
            torch.cuda.set_stream(compute)

    def ordered(self, handle: Handle) -> Handle:
        """``handle`` whose ``wait`` also makes the waiting (compute) stream wait for the gather stream's work
        issued so far (call inside ``issue``)."""
        if self.stream is None:
            return handle
        event = torch.cuda.Event()
        event.record(self.stream)
        return _AfterEvent(handle, event)


class _AfterEvent:
    __slots__ = ("_event", "_handle")

    def __init__(self, handle: Handle, event: torch.cuda.Event) -> None:
        self._handle, self._event = handle, event

    def wait(self) -> None:
        self._handle.wait()  # NCCL: the current stream waits for the collective (no host block)
        torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._handle.is_completed() and self._event.query()
