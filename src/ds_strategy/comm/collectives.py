"""``Communicator``: the collectives facade over one explicit process group.

    comm = Communicator(group)                       # group=None: the default group; collective call
    comm.all_reduce(grad, "avg")                     # sum | avg | max | min | product, in place
    h = comm.reduce_scatter_tensor(shard, flat, async_op=True); ...; h.wait()
    comm.all_gather_into_tensor(flat, shard)
    comm.broadcast(t, src=0)                         # src is a rank of ``group``
    comm.all_reduce_coalesced(small_tensors)         # one collective per dtype/device, copied back
    comm.barrier()

Every operation returns a ``CommHandle``; with ``async_op=True`` the operation (including any copy-out
or division) is finished by ``handle.wait()``, otherwise before returning. There is no module-level
communicator: build one per process group and pass it along.

[Note: routing]
CPU tensors in fp32 / bf16 / fp16 reduced with sum or avg (and all_gather of such tensors) go to the
shared-memory fast path (``ds_strategy.comm.shm.ShmCommunicator``) when every rank of the group runs on
this node and the compiled kernels load; everything else goes to torch.distributed. The fast path is
decided once, collectively, in the constructor: ``fast_path=False`` or ``DS_STRATEGY_SHM=0`` disables it,
``fast_path=True`` insists on it (an error when unavailable; the argument wins over the variable), and a
fast-path object may be injected (tests use a double). Synchronous fast-path calls are done on return;
``async_op=True`` ones run on one background thread in call order (``DS_STRATEGY_SHM_ASYNC=0`` runs them
inline; see [Note: asynchronous fast path] in worker.py). The choice depends only on the op, dtype and
device, which torch.distributed already requires to match across ranks, so every rank of a collective
takes the same path (non-contiguous all_reduce inputs are reduced through a contiguous copy for the same
reason).

[Note: gloo reduce_scatter and all_gather through all_reduce]
gloo's reduce_scatter and all_gather are slower than its all_reduce for large messages (2 ranks, 64 MB
fp32, medians over runs on a shared 2-core machine: all_reduce 87-170 ms, reduce_scatter 205-380 ms,
all_gather 185-345 ms; the emulations below took 190 ms and 113 ms in the same run as the 205 / 185 ms; from
1 to 16 MB the two are within noise of each other). On gloo (``emulate_gloo``, default on)
reduce_scatter reduces a copy of the whole input with one all_reduce and keeps this rank's shard; all_gather
writes this rank's shard into the zeroed output and sums it bytewise as integers, so the gathered values
are bit-identical (x + 0 is exact in two's complement, -0.0 and NaN payloads included). The copy of the
input can be skipped with ``input_is_scratch=True`` when the caller no longer needs it.

gloo has no AVG: avg is a sum followed by a division by the group size (on the shard only, for
reduce_scatter); nccl reduces with AVG natively.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ds_strategy.accelerator import strict
from ds_strategy.comm.logger import CommsLogger, Timing
from ds_strategy.comm.worker import CollectiveWorker

F = TypeVar("F", bound=Callable[..., Any])

SHM_ENV = "DS_STRATEGY_SHM"
SHM_ASYNC_ENV = "DS_STRATEGY_SHM_ASYNC"
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FAST_OPS = ("sum", "avg")

_REDUCE_OPS: dict[str, Any] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # AVG is sum + divide, except on nccl (see _torch_op)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
ReduceOpLike = str | dist.ReduceOp | Any  # a name above, or a torch.distributed.ReduceOp member

# torch >= 2.10 renamed the tensor collectives; use whichever this torch has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _labelled(label: str) -> Callable[[F], F]:
    """The collective's span in a profiler trace (``ds::all_reduce``, ...): its launch, and with
    ``async_op=False`` its completion."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return method(*args, **kwargs)

        return cast(F, run)

    return wrap


class FastPath(Protocol):
    """What the Communicator needs from a fast path (``ShmCommunicator`` or a test double)."""

    def supports(self, *tensors: torch.Tensor) -> bool: ...
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None: ...
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> None: ...
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None: ...
    def close(self) -> None: ...


class CommHandle:
    """Finishes one facade operation: waits for torch's work objects, runs the copy-out, records timing.

    ``wait()`` is idempotent. Dropping a handle without waiting leaves the operation unfinished.
    """

    __slots__ = ("_children", "_finish", "_logger", "_timing", "_works")

    def __init__(
        self,
        works: Sequence[dist.Work] = (),
        finish: Callable[[], None] | None = None,
        *,
        timing: Timing | None = None,
        logger: CommsLogger | None = None,
        children: Sequence[CommHandle] = (),
    ) -> None:
        self._works: list[dist.Work] | None = [w for w in works if w is not None]
        self._finish = finish
        self._timing = timing
        self._logger = logger
        self._children = list(children)

    def wait(self) -> None:
        if self._works is None:
            return
        works, self._works = self._works, None
        for work in works:
            work.wait()
        for child in self._children:
            child.wait()
        if self._finish is not None:
            self._finish()
        if self._logger is not None:
            self._logger.stop(self._timing)

    def is_completed(self) -> bool:
        """True once ``wait()`` has run, or when every underlying operation has finished."""
        if self._works is None:
            return True
        return all(w.is_completed() for w in self._works) and all(c.is_completed() for c in self._children)


class Communicator:
    """Collectives over ``group`` (None: the default group) with fast-path routing and optional logging.

    Constructing one is a collective call over ``group`` when the fast path is on (it checks that every
    rank is on one node). ``logger``: a ``CommsLogger`` to record into. ``emulate_gloo``: run gloo's
    reduce_scatter / all_gather through all_reduce (default True; see the module notes).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        logger: CommsLogger | None = None,
        fast_path: FastPath | bool | None = None,
        emulate_gloo: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "Communicator needs an initialised torch.distributed: call ds_strategy.init_distributed() first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(f"Communicator: global rank {dist.get_rank()} is not a member of the given group")
        self.backend = str(dist.get_backend(group))
        self.logger = logger
        self.emulate_gloo = emulate_gloo
        self._device_backends = _parse_backend(self.backend)
        self.fast_path: FastPath | None = self._open_fast_path(fast_path)
        # async_op fast-path calls run on one background thread (see [Note: asynchronous fast path]).
        off = _env_off(SHM_ASYNC_ENV)
        # Not for an injected fast path: a test double may itself use torch.distributed, which must stay
        # on the caller's thread.
        injected = fast_path is not None and not isinstance(fast_path, bool)
        self._worker = CollectiveWorker() if self.fast_path is not None and not (off or injected) else None

    # ---- lifecycle -----------------------------------------------------------------------------------
    def _open_fast_path(self, fast_path: FastPath | bool | None) -> FastPath | None:
        if fast_path is False:
            return None
        if fast_path is not None and fast_path is not True:
            return fast_path  # injected
        if fast_path is None and _env_off(SHM_ENV):
            return None
        opened = None if self.world_size == 1 else _create_shm(self.group)
        if opened is None and fast_path is True:
            raise RuntimeError(
                f"Communicator(fast_path=True): the shared-memory fast path is unavailable for this group of "
                f"{self.world_size} rank(s) (ranks on several hosts, kernels not built, or a group of one)"
            )
        return opened

    def close(self) -> None:
        """Release the fast path's shared memory (torch.distributed's groups are the caller's)."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.close()
        if self.fast_path is not None:
            fast, self.fast_path = self.fast_path, None
            fast.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        fast = "none" if self.fast_path is None else type(self.fast_path).__name__
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, fast_path={fast})"
        )

    # ---- routing -------------------------------------------------------------------------------------
    def path_for(self, op: ReduceOpLike | None, *tensors: torch.Tensor) -> str:
        """Which path an operation on ``tensors`` takes: "local", "shm", or the torch backend's name.

        ``op`` None means a non-reducing collective (all_gather).
        """
        if self.world_size == 1:
            return "local"
        name = None if op is None else reduce_op_name(op)
        if strict.ACTIVE:  # every tensor of the collective, whichever path (shm and the gloo emulations
            # hand torch only some of them)
            strict.check_collective(f"Communicator {name or 'all_gather'}", tensors)
        if self._fast_ok(name, tensors):
            return "shm"
        return self._torch_path(tensors[0])

    def checks_tags(self, *tensors: torch.Tensor) -> bool:
        """Whether an all_gather of ``tensors`` compares its ``tag`` across ranks (the shared-memory path)."""
        return self.path_for(None, *tensors) == "shm" and hasattr(self.fast_path, "peer_tags")

    def peer_tags(self) -> list[int]:
        """Every rank's tag for the latest fast-path collective (after a tag mismatch; see ``checks_tags``)."""
        tags = getattr(self.fast_path, "peer_tags", None)
        return [] if tags is None else list(tags())

    def _fast_ok(self, op: str | None, tensors: Sequence[torch.Tensor]) -> bool:
        return (
            self.fast_path is not None
            and (op is None or op in _FAST_OPS)
            and all(t.device.type == "cpu" and t.dtype in FAST_DTYPES and t.is_contiguous() for t in tensors)
            and self.fast_path.supports(*tensors)
        )

    def _torch_path(self, tensor: torch.Tensor) -> str:
        return self._device_backends.get(tensor.device.type, self.backend)

    # ---- collectives ---------------------------------------------------------------------------------
    @_labelled("ds::all_reduce")
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, async_op: bool = False) -> CommHandle:
        """Reduce ``tensor`` across the group, in place (a non-contiguous tensor goes through a contiguous copy)."""
        name = reduce_op_name(op)
        if tensor.is_contiguous():
            return self._all_reduce(tensor, name, async_op=async_op, label="all_reduce")
        buf = tensor.contiguous()

        def copy_back() -> None:
            tensor.copy_(buf)

        return self._all_reduce(buf, name, async_op=async_op, label="all_reduce", then=copy_back)

    @_labelled("ds::reduce_scatter")
    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOpLike = "sum",
        *,
        async_op: bool = False,
        input_is_scratch: bool = False,
    ) -> CommHandle:
        """``output`` = this rank's shard (``input.view(W, -1)[rank]``) of the reduction of ``input``.

        ``input.numel() == W * output.numel()``; ``input`` is left unchanged unless ``input_is_scratch``.
        """
        name = reduce_op_name(op)
        _check_pair("reduce_scatter_tensor", big=input, small=output, world=self.world_size)
        path = self.path_for(name, output, input)
        timing = self._start("reduce_scatter", input, path)
        if path == "local":
            if output.data_ptr() != input.data_ptr():
                output.view(-1).copy_(input.view(-1))
            return self._done(timing)
        if path == "shm":
            fast = self.fast_path
            assert fast is not None
            return self._fast(lambda: fast.reduce_scatter(output, input, name), timing, async_op)
        _check_avg(name, output)
        if path == "gloo" and self.emulate_gloo:
            timing = _relabel(timing, "gloo-ar")
            buf = input.view(-1) if input_is_scratch else input.detach().reshape(-1).clone()
            work = dist.all_reduce(buf, op=_REDUCE_OPS[name], group=self.group, async_op=True)
            mine = buf.view(self.world_size, -1)[self.rank]

            def keep_shard() -> None:
                if mine.data_ptr() != output.data_ptr():
                    output.view(-1).copy_(mine)
                if name == "avg":
                    output.div_(self.world_size)

            return self._handle([work], keep_shard, timing, async_op)
        torch_op, divide = self._torch_op(name, path)
        work = _reduce_scatter(output, input, op=torch_op, group=self.group, async_op=True)

        def average() -> None:
            output.div_(self.world_size)

        return self._handle([work], average if divide else None, timing, async_op)

    @_labelled("ds::all_gather")
    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, tag: int = 0
    ) -> CommHandle:
        """Concatenate every rank's ``input`` into ``output`` (rank order); ``input`` may be a view of
        this rank's shard of ``output``. ``tag`` labels the call where ``checks_tags`` says the path
        compares labels across ranks (a mismatch raises on every rank); other paths ignore it."""
        _check_pair("all_gather_into_tensor", big=output, small=input, world=self.world_size)
        path = self.path_for(None, output, input)
        timing = self._start("all_gather", output, path)
        shards = output.view(self.world_size, -1)
        mine = shards[self.rank]
        if path == "local":
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input.view(-1))
            return self._done(timing)
        if path == "shm":
            fast = self.fast_path
            assert fast is not None
            if tag:
                return self._fast(lambda: fast.all_gather(output, input, tag=tag), timing, async_op)  # type: ignore[call-arg]
            return self._fast(lambda: fast.all_gather(output, input), timing, async_op)
        if path == "gloo" and self.emulate_gloo:
            timing = _relabel(timing, "gloo-ar")
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input.view(-1))
            if self.rank > 0:
                shards[: self.rank].zero_()
            if self.rank < self.world_size - 1:
                shards[self.rank + 1 :].zero_()
            work = dist.all_reduce(_as_integers(output), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return self._handle([work], None, timing, async_op)
        work = _all_gather(output, input, group=self.group, async_op=True)
        return self._handle([work], None, timing, async_op)

    @_labelled("ds::broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> CommHandle:
        """Copy group rank ``src``'s ``tensor`` to every rank of the group."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src={src} is not a rank of this group of {self.world_size}")
        path = self.path_for(None, tensor) if self.world_size == 1 else self._torch_path(tensor)
        timing = self._start("broadcast", tensor, path)
        if path == "local":
            return self._done(timing)
        work = dist.broadcast(tensor, src=self._global_rank(src), group=self.group, async_op=True)
        return self._handle([work], None, timing, async_op)

    @_labelled("ds::barrier")
    def barrier(self, *, async_op: bool = False) -> CommHandle:
        """Wait until every rank of the group has reached this call."""
        devices = self._device_backends
        path = "local" if self.world_size == 1 else devices.get("cuda") or next(iter(devices.values()), self.backend)
        timing = (
            None
            if self.logger is None
            else self.logger.start("barrier", nbytes=0, world_size=self.world_size, path=path)
        )
        if path == "local":
            return self._done(timing)
        work = dist.barrier(group=self.group, async_op=True)
        return self._handle([work], None, timing, async_op)

    @_labelled("ds::all_reduce")
    def all_reduce_coalesced(
        self, tensors: Iterable[torch.Tensor], op: ReduceOpLike = "sum", *, async_op: bool = False
    ) -> CommHandle:
        """All-reduce many (small) tensors with one collective per (device, dtype): flatten, reduce, copy back."""
        name = reduce_op_name(op)
        children = []
        for bucket in _buckets(tensors):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                children.append(self._all_reduce(bucket[0], name, async_op=True, label="all_reduce_coalesced"))
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            children.append(
                self._all_reduce(flat, name, async_op=True, label="all_reduce_coalesced", then=_copy_back(flat, bucket))
            )
        return self._combine(children, async_op)

    @_labelled("ds::broadcast")
    def broadcast_coalesced(
        self, tensors: Iterable[torch.Tensor], src: int = 0, *, async_op: bool = False
    ) -> CommHandle:
        """Broadcast many tensors from group rank ``src`` with one collective per (device, dtype)."""
        children = []
        for bucket in _buckets(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            h = self.broadcast(flat, src, async_op=True)
            children.append(CommHandle(finish=_copy_back(flat, bucket), children=[h]))
        return self._combine(children, async_op)

    # ---- internals -----------------------------------------------------------------------------------
    def _all_reduce(
        self, tensor: torch.Tensor, name: str, *, async_op: bool, label: str, then: Callable[[], None] | None = None
    ) -> CommHandle:
        path = self.path_for(name, tensor)
        timing = self._start(label, tensor, path)
        if path == "local":
            if then is not None:
                then()
            return self._done(timing)
        if path == "shm":
            fast = self.fast_path
            assert fast is not None
            return self._fast(lambda: fast.all_reduce(tensor, name), timing, async_op, then)
        _check_avg(name, tensor)
        torch_op, divide = self._torch_op(name, path)
        work = dist.all_reduce(tensor, op=torch_op, group=self.group, async_op=True)

        def finish() -> None:
            if divide:
                tensor.div_(self.world_size)
            if then is not None:
                then()

        return self._handle([work], finish, timing, async_op)

    def _torch_op(self, name: str, path: str) -> tuple[Any, bool]:
        """(torch ReduceOp, divide afterwards?): nccl averages natively, other backends sum then divide."""
        if name == "avg":
            return (dist.ReduceOp.AVG, False) if path == "nccl" else (dist.ReduceOp.SUM, True)
        return _REDUCE_OPS[name], False

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _start(self, op: str, tensor: torch.Tensor, path: str) -> Timing | None:
        if self.logger is None:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        return self.logger.start(op, nbytes=nbytes, world_size=self.world_size, path=path, device=tensor.device)

    def _fast(
        self, run: Callable[[], None], timing: Timing | None, async_op: bool, then: Callable[[], None] | None = None
    ) -> CommHandle:
        """A fast-path call: queued to the worker when asynchronous, else run now (after anything queued)."""
        if self._worker is not None and async_op:
            return CommHandle([self._worker.submit(run)], then, timing=timing, logger=self.logger)  # type: ignore[list-item]
        if self._worker is not None:
            self._worker.run(run)
        else:
            run()
        if then is not None:
            then()
        return self._done(timing)

    def _done(self, timing: Timing | None) -> CommHandle:
        handle = CommHandle(timing=timing, logger=self.logger)
        handle.wait()
        return handle

    def _handle(
        self, works: list[dist.Work], finish: Callable[[], None] | None, timing: Timing | None, async_op: bool
    ) -> CommHandle:
        handle = CommHandle(works, finish, timing=timing, logger=self.logger)
        if not async_op:
            handle.wait()
        return handle

    @staticmethod
    def _combine(children: list[CommHandle], async_op: bool) -> CommHandle:
        handle = CommHandle(children=children)
        if not async_op:
            handle.wait()
        return handle


# ---- helpers -------------------------------------------------------------------------------------------


def _env_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def reduce_op_name(op: ReduceOpLike) -> str:
    """ "sum" | "avg" | "max" | "min" | "product" from a name (case-insensitive, "mean" = "avg") or a ReduceOp."""
    if isinstance(op, str):
        name = op.strip().lower()
        name = {"mean": "avg", "prod": "product"}.get(name, name)
        if name not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(_REDUCE_OPS)}")
        return name
    for name, member in (
        ("sum", dist.ReduceOp.SUM),
        ("avg", dist.ReduceOp.AVG),
        ("max", dist.ReduceOp.MAX),
        ("min", dist.ReduceOp.MIN),
        ("product", dist.ReduceOp.PRODUCT),
    ):
        if op == member:
            return name
    raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(_REDUCE_OPS)}")


def _create_shm(group: dist.ProcessGroup | None) -> FastPath | None:
    try:
        from ds_strategy.comm.shm import ShmCommunicator  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError as exc:
        if exc.name in ("ds_strategy.comm.shm",):
            return None  # this build has no shared-memory backend
        raise
    except ImportError as exc:  # e.g. an undefined symbol in the kernel library: report, then do without
        warnings.warn(f"shared-memory collectives unavailable ({exc}); using torch.distributed", stacklevel=3)
        return None
    fast: FastPath | None = ShmCommunicator.create(group)
    return fast


def _parse_backend(backend: str) -> dict[str, str]:
    """ "cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}; a plain name maps no device specially."""
    if ":" not in backend:
        return {}
    pairs = (item.split(":", 1) for item in backend.split(",") if ":" in item)
    return {device.strip(): name.strip() for device, name in pairs}


def _check_pair(op: str, *, big: torch.Tensor, small: torch.Tensor, world: int) -> None:
    if big.numel() != world * small.numel():
        raise ValueError(
            f"{op}: the full buffer has {big.numel()} elements, expected world size {world} x shard "
            f"{small.numel()} = {world * small.numel()}"
        )
    if big.dtype != small.dtype or big.device != small.device:
        raise ValueError(f"{op}: buffers differ: {big.dtype} on {big.device} vs {small.dtype} on {small.device}")
    if not (big.is_contiguous() and small.is_contiguous()):
        raise ValueError(f"{op}: both buffers must be contiguous")


def _check_avg(name: str, tensor: torch.Tensor) -> None:
    if name == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"avg of a {tensor.dtype} tensor: averaging needs a floating-point dtype")


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
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


def _buckets(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    return list(buckets.values())


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> Callable[[], None]:
    def copy() -> None:
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view_as(t))

    return copy


def _relabel(timing: Timing | None, path: str) -> Timing | None:
    return None if timing is None else replace(timing, path=path)
