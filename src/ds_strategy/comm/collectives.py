"""``Communicator``: the collectives facade over one explicit process group.

    comm = Communicator(group)                       # group=None: the default group; collective call
    comm.all_reduce(grad, "avg")                     # sum | avg | max | min | product, in place
    h = comm.reduce_scatter_tensor(shard, flat, async_op=True); ...; h.wait()
    comm.all_gather_into_tensor(flat, shard)
    comm.broadcast(t, src=0)                         # src is a rank of ``group``
    comm.all_to_all_single(out, inp)                 # piece j of inp (dim 0) to rank j, like torch
    comm.all_reduce_coalesced(small_tensors)         # one collective per dtype/device, copied back
    comm.barrier()

Every operation returns a ``CommHandle``; with ``async_op=True`` the operation (including any copy-out
or division) is finished by ``handle.wait()``, otherwise before returning. There is no module-level
communicator: build one per process group and pass it along.

[Note: routing]
Each call picks one ``CollectivePath`` (paths.py: local, shared memory, gloo, torch/NCCL; built once per
communicator) and hands it the call; the path starts it and returns what to wait for. CPU tensors in
fp32 / bf16 / fp16 reduced with sum or avg (and all_gather and equal-split all_to_all_single of such
tensors) go to the shared-memory path (``ds_strategy.comm.shm.ShmCommunicator``) when every rank of the
group runs on this node and the compiled kernels load; everything else goes to torch.distributed. The fast
path is decided once, collectively, in the constructor: ``fast_path=False`` or ``DS_STRATEGY_SHM=0`` disables it,
``fast_path=True`` insists on it (an error when unavailable; the argument wins over the variable), and a
fast-path object may be injected (tests use a double). Synchronous fast-path calls are done on return;
``async_op=True`` ones run on one background thread in call order (``DS_STRATEGY_SHM_ASYNC=0`` runs them
inline; see [Note: asynchronous fast path] in worker.py). The choice depends only on the op, dtype and
device, which torch.distributed already requires to match across ranks, so every rank of a collective
takes the same path (non-contiguous all_reduce inputs are reduced through a contiguous copy for the same
reason).

[Note: one worker for several groups]
A process that runs collectives of several groups through shared memory (an MoE model: the data-parallel
group's asynchronous gradient reduce-scatters, the expert-parallel group's all-to-alls in forward and
backward) would otherwise have one thread per group waiting in the kernels' barriers at once; on a loaded
machine with few cores those threads take the cores from the ranks they wait for (measured: a 2-rank MoE
GPT's backward took 1.07 s with two threads, 0.07 s with one). ``Communicator(group, worker_from=other)``
queues this communicator's calls on ``other``'s worker thread, so each process runs its shared-memory
collectives one at a time, in issue order; every rank issues them in the same order, so the order of each
segment's calls is still the same on every rank. The owner closes the worker.

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

[Note: a group without peers]
Under torch's fake process group (one process standing for rank r of N; [Note: the fake process group] in
comm/distributed.py) ``is_fake`` is True and ``has_peers`` False: no shared-memory path is opened (its
barriers would wait for peers that do not exist; ``fast_path=True`` is an error there), and every
collective goes to torch.distributed as is (path ``"fake"`` in the comms log, no gloo emulation), which
returns at once. The collectives issued, their sizes and their order are those of a real rank of N; the
values received are not (an all_reduce leaves the tensor as it was), so code that compares what the ranks
sent must not count on the other ranks' values where ``has_peers`` is False (stage 3's divergence headers
compare only the slots a rank filled).
"""

from __future__ import annotations

import datetime
import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from ds_strategy import env
from ds_strategy.accelerator import strict
from ds_strategy.accelerator.spans import span
from ds_strategy.comm.fake import FAKE_BACKEND, is_fake_backend
from ds_strategy.comm.logger import CommsLogger, Timing
from ds_strategy.comm.ownership import track_communicator
from ds_strategy.comm.paths import (
    REDUCE_OPS,
    CollectivePath,
    FastPath,
    GlooPath,
    Launch,
    LocalPath,
    ShmPath,
    TorchPath,
)
from ds_strategy.comm.worker import CollectiveWorker

F = TypeVar("F", bound=Callable[..., Any])

SHM_ENV = env.SHM
SHM_ASYNC_ENV = env.SHM_ASYNC
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FAST_OPS = ("sum", "avg")

ReduceOpLike = str | dist.ReduceOp | Any  # a name above, or a torch.distributed.ReduceOp member


def _labelled(label: str) -> Callable[[F], F]:
    """The collective's span in a profiler trace (``ds::all_reduce``, ...): its launch, and with
    ``async_op=False`` its completion."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            with span(label):
                return method(*args, **kwargs)

        return cast(F, run)

    return wrap


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

    def wait(self, timeout: float | None = None) -> None:
        """Finish the operation; ``timeout`` (seconds) bounds each underlying wait (a RuntimeError past it)."""
        if self._works is None:
            return
        works, self._works = self._works, None
        limit = None if timeout is None else datetime.timedelta(seconds=timeout)
        for work in works:
            if limit is None:
                work.wait()
            else:
                work.wait(limit)
        for child in self._children:
            child.wait(timeout)
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
        worker_from: Communicator | None = None,
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
        # torch's fake process group: N ranks simulated by this one process (see [Note: a group without peers]).
        self.is_fake = is_fake_backend(self.backend)
        self.logger = logger
        self.emulate_gloo = emulate_gloo
        self._device_backends = _parse_backend(self.backend)
        self.fast_path: FastPath | None = self._open_fast_path(fast_path)
        # async_op fast-path calls run on one background thread (see [Note: asynchronous fast path]).
        off = env.is_off(SHM_ASYNC_ENV)
        # Not for an injected fast path: a test double may itself use torch.distributed, which must stay
        # on the caller's thread.
        injected = fast_path is not None and not isinstance(fast_path, bool)
        self._worker = CollectiveWorker() if self.fast_path is not None and not (off or injected) else None
        # ``worker_from``: run this communicator's shared-memory calls on another communicator's worker thread,
        # in one FIFO with its calls (see [Note: one worker for several groups]).
        self._owns_worker = True
        if worker_from is not None and worker_from._worker is not None and self._worker is not None:
            self._worker.close()
            self._worker, self._owns_worker = worker_from._worker, False
        # The paths, built once (see paths.py); a call picks one in _route.
        self._local = LocalPath()
        self._shm = None if self.fast_path is None else ShmPath(self.fast_path, self._worker)
        self._torch: dict[str, CollectivePath] = {}
        self._released = False
        track_communicator(self)  # weakly: its group's owner releases it (see comm/ownership.py)

    @property
    def has_peers(self) -> bool:
        """Whether other processes receive what this one sends: False for a group of one and for a fake
        group, where what a collective returns is not the other ranks' data (do not compare it)."""
        return self.world_size > 1 and not self.is_fake

    # ---- lifecycle -----------------------------------------------------------------------------------
    def _open_fast_path(self, fast_path: FastPath | bool | None) -> FastPath | None:
        if fast_path is False:
            return None
        if fast_path is not None and fast_path is not True:
            return fast_path  # injected
        if self.is_fake:
            if fast_path is True:
                raise RuntimeError(
                    f"Communicator(fast_path=True): the group's backend is {FAKE_BACKEND!r} (torch's fake process "
                    "group): there are no peer processes to share memory with"
                )
            return None
        if fast_path is None and env.is_off(SHM_ENV):
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
            if self._owns_worker:
                worker.close()
        if self.fast_path is not None:
            fast, self.fast_path, self._shm = self.fast_path, None, None
            fast.close()

    def release(self) -> None:
        """``close()``, then drop every reference to the process group: called when the group's owner
        destroys it, or at exit for a group that was destroyed (see [Note: clean exits by ownership] in
        comm/ownership.py). A collective on a released communicator raises."""
        self.close()
        if self.group is not None:
            self._released = True
            self.group = None
            self._torch = {}

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        fast = "none" if self.fast_path is None else type(self.fast_path).__name__
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, fast_path={fast})"
        )

    # ---- routing (see [Note: routing]) ---------------------------------------------------------------
    def path_for(self, op: ReduceOpLike | None, *tensors: torch.Tensor) -> str:
        """Which path an operation on ``tensors`` takes: "local", "shm", or the torch backend's name.

        ``op`` None means a non-reducing collective (all_gather).
        """
        return self._route(None if op is None else reduce_op_name(op), tensors).name

    def route(self, op: ReduceOpLike | None, *tensors: torch.Tensor) -> CollectivePath:
        """The ``CollectivePath`` an operation on ``tensors`` takes (its tags, peer tags and timeout)."""
        return self._route(None if op is None else reduce_op_name(op), tensors)

    def checks_tags(self, *tensors: torch.Tensor) -> bool:
        """Whether an all_gather of ``tensors`` compares its ``tag`` across ranks (the shared-memory path)."""
        return self._route(None, tensors).compares_tags

    def peer_tags(self) -> list[int]:
        """Every rank's tag for the latest fast-path collective (after a tag mismatch; see ``checks_tags``)."""
        return [] if self._shm is None else self._shm.peer_tags()

    def _route(self, name: str | None, tensors: Sequence[torch.Tensor]) -> CollectivePath:
        self._check_live(name or "all_gather")
        if self.world_size == 1:
            return self._local
        if strict.ACTIVE:  # every tensor of the collective, whichever path (shm and the gloo emulations
            # hand torch only some of them)
            strict.check_collective(f"Communicator {name or 'all_gather'}", tensors)
        if self._shm is not None and self._fast_ok(name, tensors):
            return self._shm
        return self._torch_for(tensors[0])

    def _check_live(self, what: str) -> None:
        if self._released:
            raise RuntimeError(
                f"Communicator {what}: this communicator was released (its process group was destroyed by the "
                "object that created it, or at exit); build a new one on a live group"
            )

    def _fast_ok(self, op: str | None, tensors: Sequence[torch.Tensor]) -> bool:
        return (
            self.fast_path is not None
            and (op is None or op in _FAST_OPS)
            and all(t.device.type == "cpu" and t.dtype in FAST_DTYPES and t.is_contiguous() for t in tensors)
            and self.fast_path.supports(*tensors)
        )

    def _torch_for(self, tensor: torch.Tensor) -> CollectivePath:
        return self._torch_path_named(self._device_backends.get(tensor.device.type, self.backend))

    def _torch_path_named(self, backend: str) -> CollectivePath:
        self._check_live(backend)
        path = self._torch.get(backend)
        if path is None:
            kind = GlooPath if backend == "gloo" and self.emulate_gloo and not self.is_fake else TorchPath
            path = self._torch[backend] = kind(self.group, backend, self.rank, self.world_size)
        return path

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
        path = self._route(name, (output, input))
        if isinstance(path, TorchPath):
            _check_avg(name, output)
        return self._issue(
            "reduce_scatter",
            input,
            path,
            lambda: path.reduce_scatter(output, input, name, async_op=async_op, input_is_scratch=input_is_scratch),
            async_op,
        )

    @_labelled("ds::all_gather")
    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, tag: int = 0
    ) -> CommHandle:
        """Concatenate every rank's ``input`` into ``output`` (rank order); ``input`` may be a view of
        this rank's shard of ``output``. ``tag`` labels the call where ``checks_tags`` says the path
        compares labels across ranks (a mismatch raises on every rank); other paths ignore it."""
        _check_pair("all_gather_into_tensor", big=output, small=input, world=self.world_size)
        path = self._route(None, (output, input))
        return self._issue(
            "all_gather", output, path, lambda: path.all_gather(output, input, async_op=async_op, tag=tag), async_op
        )

    @_labelled("ds::all_to_all")
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        async_op: bool = False,
    ) -> CommHandle:
        """torch's ``all_to_all_single`` over the group: ``input`` is cut along dim 0 into W pieces (equal,
        or ``input_split_sizes`` rows), piece j goes to group rank j, and ``output`` receives, in rank
        order, the piece every rank cut for this one (``output_split_sizes`` rows each, else equal).

        Equal splits need ``input.shape[0]`` and ``output.shape[0]`` divisible by W. The expert-parallel
        token exchange of ``ds_strategy.moe`` runs through here (gloo / nccl, or the shared-memory path with
        a kernel for equal splits of CPU float tensors: ``csrc/comm/shm_collectives.cpp``).
        """
        if output.dtype != input.dtype or output.device != input.device:
            raise ValueError(
                f"all_to_all_single: output is {output.dtype} on {output.device}, input {input.dtype} on "
                f"{input.device}; they must match"
            )
        if input_split_sizes is None and input.shape[0] % self.world_size:
            raise ValueError(
                f"all_to_all_single: input has {input.shape[0]} rows, not divisible by the group size "
                f"{self.world_size}; pass input_split_sizes"
            )
        if output_split_sizes is None and output.shape[0] % self.world_size:
            raise ValueError(
                f"all_to_all_single: output has {output.shape[0]} rows, not divisible by the group size "
                f"{self.world_size}; pass output_split_sizes"
            )
        if self.world_size == 1:
            if output.numel() != input.numel():
                raise ValueError(
                    f"all_to_all_single: a group of one needs output ({output.numel()}) and input "
                    f"({input.numel()}) of one size"
                )
            path: CollectivePath = self._local
            output.view(-1).copy_(input.reshape(-1))
            return self._finish(Launch(ran=True), self._start("all_to_all", input, path.name), async_op)
        if strict.ACTIVE:
            strict.check_collective("Communicator all_to_all_single", (output, input))
        shm = self._shm
        if (
            shm is not None
            and output_split_sizes is None
            and input_split_sizes is None
            and output.numel() == input.numel()
            and hasattr(self.fast_path, "all_to_all")
            and self._fast_ok(None, (output, input))
            and not _overlap(output, input)
        ):
            return self._issue(
                "all_to_all", input, shm, lambda: shm.all_to_all(output, input, async_op=async_op), async_op
            )
        path = self._torch_for(input)
        group = self.group

        def start() -> Launch:
            work = dist.all_to_all_single(
                output,
                input,
                output_split_sizes=None if output_split_sizes is None else list(output_split_sizes),
                input_split_sizes=None if input_split_sizes is None else list(input_split_sizes),
                group=group,
                async_op=True,
            )
            return Launch([work])

        return self._issue("all_to_all", input, path, start, async_op)

    @_labelled("ds::broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False) -> CommHandle:
        """Copy group rank ``src``'s ``tensor`` to every rank of the group."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src={src} is not a rank of this group of {self.world_size}")
        path = self._route(None, (tensor,)) if self.world_size == 1 else self._torch_for(tensor)
        return self._issue("broadcast", tensor, path, lambda: path.broadcast(tensor, src, async_op=async_op), async_op)

    @_labelled("ds::barrier")
    def barrier(self, *, async_op: bool = False) -> CommHandle:
        """Wait until every rank of the group has reached this call."""
        devices = self._device_backends
        if self.world_size == 1:
            path: CollectivePath = self._local
        else:
            path = self._torch_path_named(devices.get("cuda") or next(iter(devices.values()), self.backend))
        timing = (
            None
            if self.logger is None
            else self.logger.start("barrier", nbytes=0, world_size=self.world_size, path=path.name)
        )
        return self._finish(path.barrier(async_op=async_op), timing, async_op)

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
        path = self._route(name, (tensor,))
        if isinstance(path, TorchPath):
            _check_avg(name, tensor)
        return self._issue(
            label, tensor, path, lambda: path.all_reduce(tensor, name, async_op=async_op), async_op, then
        )

    def _issue(
        self,
        op: str,
        tensor: torch.Tensor,
        path: CollectivePath,
        start: Callable[[], Launch],
        async_op: bool,
        then: Callable[[], None] | None = None,
    ) -> CommHandle:
        """Time and start one collective on ``path``; its handle finishes it (now, unless ``async_op``)."""
        timing = self._start(op, tensor, path.name)  # before the start: a synchronous path runs inside it
        launch = start()
        if launch.label is not None:
            timing = _relabel(timing, launch.label)
        finish = launch.finish
        if then is not None:
            finish = then if finish is None else _chain(finish, then)
        return self._finish(Launch(launch.works, finish, ran=launch.ran), timing, async_op)

    def _finish(self, launch: Launch, timing: Timing | None, async_op: bool) -> CommHandle:
        # A fake group's work has nothing to wait for, yet never reports itself completed: kept, it would hold
        # every poller's buffers until an explicit wait, which a real rank frees as its collectives land.
        works = () if self.is_fake else launch.works
        handle = CommHandle(works, launch.finish, timing=timing, logger=self.logger)
        if not async_op or launch.ran:
            handle.wait()
        return handle

    def _start(self, op: str, tensor: torch.Tensor, path: str) -> Timing | None:
        if self.logger is None:
            return None
        nbytes = tensor.numel() * tensor.element_size()
        return self.logger.start(op, nbytes=nbytes, world_size=self.world_size, path=path, device=tensor.device)

    @staticmethod
    def _combine(children: list[CommHandle], async_op: bool) -> CommHandle:
        handle = CommHandle(children=children)
        if not async_op:
            handle.wait()
        return handle


# ---- helpers -------------------------------------------------------------------------------------------


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def reduce_op_name(op: ReduceOpLike) -> str:
    """ "sum" | "avg" | "max" | "min" | "product" from a name (case-insensitive, "mean" = "avg") or a ReduceOp."""
    if isinstance(op, str):
        name = op.strip().lower()
        name = {"mean": "avg", "prod": "product"}.get(name, name)
        if name not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
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
    raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")


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


def _chain(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()

    return both


def _relabel(timing: Timing | None, path: str) -> Timing | None:
    return None if timing is None else replace(timing, path=path)
