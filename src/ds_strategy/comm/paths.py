"""The ways a collective can travel, as objects behind one ``CollectivePath`` protocol.

``Communicator`` (collectives.py) picks one path per call from the op, dtype and device ([Note: routing]
there) and hands it the call; the path starts the operation and returns a ``Launch``: the work objects
to wait for and the step that completes the result (copy a shard out, divide for an average). Tags,
the peers' tags after a mismatch, and how long a wait may take are part of the protocol, so code that
checks agreement across ranks (stage 3's divergence detection) asks the path instead of knowing it.

- ``LocalPath``: a group of one; copies where input and output differ.
- ``ShmPath``: the shared-memory kernels (CPU ranks of one node); compares tags; asynchronous calls queue
  on one background thread (worker.py).
- ``TorchPath``: torch.distributed as is (NCCL, or gloo for what it does well); NCCL averages natively.
- ``GlooPath``: gloo with reduce_scatter and all_gather run through all_reduce ([Note: gloo reduce_scatter
  and all_gather through all_reduce] in collectives.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ds_strategy.comm.worker import CollectiveWorker

REDUCE_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # AVG is sum + divide, except on nccl (see TorchPath._op)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# torch >= 2.10 renamed the tensor collectives; use whichever this torch has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Launch:
    """What a path started: work objects (torch's, or the shared-memory worker's job) to wait for, the step
    that completes the result once they are done, and the path's name in the comms log where it differs."""

    works: list[Any] = field(default_factory=list)
    finish: Callable[[], None] | None = None
    label: str | None = None
    ran: bool = False  # the operation already ran on this thread: finish it now, even when asynchronous


class CollectivePath(Protocol):
    name: str  # in the comms log and in ``Communicator.path_for``
    compares_tags: bool  # all_gather's ``tag`` is compared across ranks (a mismatch raises on every rank)
    timeout: float | None  # seconds one collective may wait on this path (None: the process group's timeout)

    def all_reduce(self, tensor: torch.Tensor, op: str, *, async_op: bool) -> Launch: ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, *, async_op: bool, input_is_scratch: bool
    ) -> Launch: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, tag: int) -> Launch: ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool) -> Launch: ...

    def barrier(self, *, async_op: bool) -> Launch: ...

    def peer_tags(self) -> list[int]:
        """Every rank's tag of the latest tagged collective (after a mismatch); [] where tags are not compared."""
        ...


class FastPath(Protocol):
    """What the shared-memory path needs from its kernels (``ShmCommunicator`` or a test double)."""

    def supports(self, *tensors: torch.Tensor) -> bool: ...
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None: ...
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> None: ...
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...
    def close(self) -> None: ...


class LocalPath:
    """A group of one: nothing travels."""

    name = "local"
    compares_tags = False
    timeout: float | None = None

    def all_reduce(self, tensor: torch.Tensor, op: str, *, async_op: bool) -> Launch:
        return Launch()

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, *, async_op: bool, input_is_scratch: bool
    ) -> Launch:
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.view(-1))
        return Launch()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, tag: int) -> Launch:
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.view(-1))
        return Launch()

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool) -> Launch:
        return Launch()

    def barrier(self, *, async_op: bool) -> Launch:
        return Launch()

    def peer_tags(self) -> list[int]:
        return []


class ShmPath:
    """The shared-memory kernels: synchronous calls run now (after anything queued), asynchronous ones
    queue on the worker thread in call order (``worker`` None: everything runs now)."""

    name = "shm"

    def __init__(self, fast: FastPath, worker: CollectiveWorker | None) -> None:
        self.fast = fast
        self.worker = worker
        self.compares_tags = hasattr(fast, "peer_tags")

    @property
    def timeout(self) -> float | None:
        """The kernels' own bound on a wait for the peers (seconds); settable."""
        value = getattr(self.fast, "timeout", None)
        return None if value is None else float(value)

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self.fast.timeout = seconds  # type: ignore[attr-defined]

    def _run(self, call: Callable[[], None], async_op: bool) -> Launch:
        if self.worker is not None and async_op:
            return Launch([self.worker.submit(call)])
        if self.worker is not None:
            self.worker.run(call)
        else:
            call()
        return Launch(ran=True)

    def all_reduce(self, tensor: torch.Tensor, op: str, *, async_op: bool) -> Launch:
        return self._run(lambda: self.fast.all_reduce(tensor, op), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, *, async_op: bool, input_is_scratch: bool
    ) -> Launch:
        return self._run(lambda: self.fast.reduce_scatter(output, input, op), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, tag: int) -> Launch:
        if tag:
            return self._run(lambda: self.fast.all_gather(output, input, tag=tag), async_op)  # type: ignore[call-arg]
        return self._run(lambda: self.fast.all_gather(output, input), async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool) -> Launch:
        fast: Any = self.fast  # all_to_all is optional on a FastPath (an injected double may lack it)
        return self._run(lambda: fast.all_to_all(output, input), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool) -> Launch:
        raise NotImplementedError("broadcast travels through torch.distributed")  # never routed here

    def barrier(self, *, async_op: bool) -> Launch:
        raise NotImplementedError("barrier travels through torch.distributed")  # never routed here

    def peer_tags(self) -> list[int]:
        tags = getattr(self.fast, "peer_tags", None)
        return [] if tags is None else list(tags())


class TorchPath:
    """torch.distributed over ``group`` with ``backend`` (the name of the backend for this device)."""

    compares_tags = False
    timeout: float | None = None

    def __init__(self, group: dist.ProcessGroup | None, backend: str, rank: int, world_size: int) -> None:
        self.group = group
        self.name = backend
        self.rank = rank
        self.world_size = world_size

    def _op(self, name: str) -> tuple[Any, bool]:
        """(torch ReduceOp, divide afterwards?): nccl averages natively, other backends sum then divide."""
        if name == "avg":
            return (dist.ReduceOp.AVG, False) if self.name == "nccl" else (dist.ReduceOp.SUM, True)
        return REDUCE_OPS[name], False

    def _divide(self, tensor: torch.Tensor, divide: bool) -> Callable[[], None] | None:
        if not divide:
            return None

        def average() -> None:
            tensor.div_(self.world_size)

        return average

    def all_reduce(self, tensor: torch.Tensor, op: str, *, async_op: bool) -> Launch:
        torch_op, divide = self._op(op)
        work = dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=True)
        return Launch([work], self._divide(tensor, divide))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, *, async_op: bool, input_is_scratch: bool
    ) -> Launch:
        torch_op, divide = self._op(op)
        work = _reduce_scatter(output, input, op=torch_op, group=self.group, async_op=True)
        return Launch([work], self._divide(output, divide))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, tag: int) -> Launch:
        return Launch([_all_gather(output, input, group=self.group, async_op=True)])

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool) -> Launch:
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        return Launch([dist.broadcast(tensor, src=global_src, group=self.group, async_op=True)])

    def barrier(self, *, async_op: bool) -> Launch:
        return Launch([dist.barrier(group=self.group, async_op=True)])

    def peer_tags(self) -> list[int]:
        return []


class GlooPath(TorchPath):
    """gloo, with reduce_scatter and all_gather through its faster all_reduce (bit-identical results)."""

    EMULATED = "gloo-ar"

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, *, async_op: bool, input_is_scratch: bool
    ) -> Launch:
        buf = input.view(-1) if input_is_scratch else input.detach().reshape(-1).clone()
        work = dist.all_reduce(buf, op=REDUCE_OPS[op], group=self.group, async_op=True)
        mine = buf.view(self.world_size, -1)[self.rank]

        def keep_shard() -> None:
            if mine.data_ptr() != output.data_ptr():
                output.view(-1).copy_(mine)
            if op == "avg":
                output.div_(self.world_size)

        return Launch([work], keep_shard, label=self.EMULATED)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool, tag: int) -> Launch:
        # This rank's shard into the zeroed output, then an integer sum of the bytes: x + 0 is exact in
        # two's complement, so the gathered values (-0.0 and NaN payloads included) are bit-identical.
        shards = output.view(self.world_size, -1)
        mine = shards[self.rank]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input.view(-1))
        if self.rank > 0:
            shards[: self.rank].zero_()
        if self.rank < self.world_size - 1:
            shards[self.rank + 1 :].zero_()
        work = dist.all_reduce(as_integers(output), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Launch([work], label=self.EMULATED)


def as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor (int32 where the size and alignment allow, else uint8)."""
    flat = tensor.view(-1)
    if flat.dtype in (torch.int32, torch.uint8):
        return flat
    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0 and raw.data_ptr() % 4 == 0:
        try:
            return raw.view(torch.int32)
        except RuntimeError:
            pass
    return raw
