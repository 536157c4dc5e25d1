"""Shared-memory collectives for the ranks of one node (CPU tensors), faster than gloo over loopback.

    comm = ShmCommunicator.create(group)       # collective; None unless every rank is on this host
    if comm is not None and comm.supports(grad):
        comm.all_reduce(grad, op="avg")
    else:
        dist.all_reduce(grad, group=group)     # gloo: the fallback

The C++ side (csrc/comm/) maps one segment per communicator: rank 0 creates it owner-only (mode 0600) under
a random name, the name travels to the peers over the process group, and the last rank to attach unlinks
it, so nothing is left in /dev/shm afterwards, even when a rank crashes. Every wait is bounded: a rank that
does not arrive within ``timeout`` seconds (or whose process has exited) makes the others raise a
RuntimeError naming it. All ranks of the group must call the same collectives in the same order, exactly as
with torch.distributed; a mismatch of op, dtype or size raises on every rank with each rank's call listed.

Tuning knobs (environment): ``DS_STRATEGY_SHM_TIMEOUT`` (seconds, default 1800 like torch's process
groups), ``DS_STRATEGY_SHM_SLOT_BYTES`` (per-rank chunk, default 2 MiB), ``DS_STRATEGY_SHM_SMALL_BYTES``
(all-reduces up to this size take the one-barrier path, default 64 KiB), ``DS_STRATEGY_SHM_STREAM_BYTES``
(all-gather outputs from this size are written with streaming stores, default 8 MiB).
"""

from __future__ import annotations

import socket
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_strategy import env
from ds_strategy.comm.fake import is_fake_group

TIMEOUT_ENV = env.SHM_TIMEOUT
SLOT_BYTES_ENV = env.SHM_SLOT_BYTES
SMALL_BYTES_ENV = env.SHM_SMALL_BYTES
DEFAULT_TIMEOUT = 1800.0
DEFAULT_SLOT_BYTES = 2 << 20
DEFAULT_SMALL_BYTES = 64 << 10
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OPS = ("sum", "avg")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def host_identity() -> tuple[str, str]:
    """Two processes can share /dev/shm only on one running kernel: same host name and same boot id."""
    return socket.gethostname(), _boot_id()


def kernel_class() -> Any:
    """The compiled ``ShmComm`` class, or None when the CPU kernels cannot be loaded here."""
    from ds_strategy.ops.builder import load_cpu_kernels

    if not load_cpu_kernels():
        return None
    return torch.classes.ds_strategy.ShmComm


def env_number(name: str, default: float) -> float:
    """``$name`` (a positive number), else ``default``."""
    value = env.positive_number(name)
    return default if value is None else value


class ShmCommunicator:
    """One shared-memory segment connecting the ranks of ``group`` (all on one host). Use :meth:`create`."""

    def __init__(self, handle: Any, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self._handle = handle
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @staticmethod
    def create(group: dist.ProcessGroup | None = None, *, timeout: float | None = None) -> ShmCommunicator | None:
        """Collective over ``group`` (default: the world). Returns a communicator on every rank, or None on
        every rank when the group spans several hosts, has one rank, is torch's fake group (no peers), or the
        CPU kernels do not load."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world_size = dist.get_world_size(group)
        if world_size < 2 or is_fake_group(group):  # a fake group: no peer process would ever attach
            return None
        rank = dist.get_rank(group)
        seconds = float(timeout) if timeout is not None else env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT)
        if seconds <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        slot_bytes = int(env_number(SLOT_BYTES_ENV, DEFAULT_SLOT_BYTES))
        small_bytes = int(env_number(SMALL_BYTES_ENV, DEFAULT_SMALL_BYTES))

        # Load the kernels before anything collective, and never raise between collectives: a rank that
        # raised here would leave its peers blocked in the next gather.
        cls: Any = None
        load_error = ""
        try:
            cls = kernel_class()
        except Exception as err:  # reported below, on every rank: raising here would hang the peers
            load_error = f"{type(err).__name__}: {err}"
        facts: list[Any] = [None] * world_size
        dist.all_gather_object(facts, (host_identity(), cls is not None, load_error), group=group)
        if len({f[0] for f in facts}) != 1 or not all(f[1] for f in facts):
            errors = {r: f[2] for r, f in enumerate(facts) if f[2]}
            if errors:
                warnings.warn(
                    f"shared-memory collectives disabled, kernels failed: {errors}", RuntimeWarning, stacklevel=2
                )
            return None

        handle, error = None, ""
        src = dist.get_global_rank(group, 0) if group is not None else 0
        try:
            if rank == 0:
                try:
                    handle = cls(rank, world_size, slot_bytes, small_bytes, seconds, "")
                    message: list[Any] = [handle.name(), ""]
                except RuntimeError as err:
                    message = ["", str(err)]
                dist.broadcast_object_list(message, src=src, group=group)
                error = message[1]
            else:
                message = [None, None]
                dist.broadcast_object_list(message, src=src, group=group)
                if message[0]:
                    try:
                        handle = cls(rank, world_size, slot_bytes, small_bytes, seconds, message[0])
                    except RuntimeError as err:
                        error = str(err)
                else:
                    error = f"rank 0 could not create the segment: {message[1]}"
            outcomes: list[Any] = [None] * world_size
            dist.all_gather_object(outcomes, error, group=group)
        finally:
            # Normally already unlinked by the last rank to attach; this covers a rank that never attached.
            if rank == 0 and handle is not None:
                handle.unlink()
        failed = {r: e for r, e in enumerate(outcomes) if e}
        if failed:
            if handle is not None:
                handle.close()
            warnings.warn(f"shared-memory collectives disabled: {failed}", RuntimeWarning, stacklevel=2)
            return None
        return ShmCommunicator(handle, group, rank, world_size)

    # -- checks -----------------------------------------------------------------------------------------

    @staticmethod
    def supports(*tensors: torch.Tensor) -> bool:
        """True when every tensor is a contiguous CPU float32/bfloat16/float16 tensor of one dtype."""
        if not tensors:
            return False
        dtype = tensors[0].dtype
        return all(
            t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype and t.dtype in SUPPORTED_DTYPES
            for t in tensors
        )

    def _check(self, op: str, **tensors: torch.Tensor) -> None:
        if self._handle is None or self._handle.closed():
            raise ValueError(f"shm {op}: the communicator is closed")
        dtype = None
        for arg, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"shm {op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"shm {op}: {arg} is on {t.device}; shared-memory collectives take CPU tensors")
            if t.dtype not in SUPPORTED_DTYPES:
                valid = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
                raise ValueError(f"shm {op}: {arg} has dtype {t.dtype}; valid dtypes are {valid}")
            if not t.is_contiguous():
                raise ValueError(f"shm {op}: {arg} is not contiguous; pass a contiguous tensor (and copy back)")
            if dtype is not None and t.dtype != dtype:
                raise ValueError(f"shm {op}: {arg} has dtype {t.dtype} but {next(iter(tensors))} has {dtype}")
            dtype = t.dtype

    @staticmethod
    def _check_op(op: str, reduce_op: str) -> None:
        if reduce_op not in _OPS:
            raise ValueError(f"shm {op}: op must be one of {_OPS}, got {reduce_op!r}")

    # -- collectives ------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In place: every rank's ``tensor`` becomes the sum (or average) over the ranks."""
        self._check("all_reduce", tensor=tensor)
        self._check_op("all_reduce", op)
        self._handle.all_reduce(tensor.detach(), op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> None:
        """``output`` = this rank's shard (``input[rank * n:(rank + 1) * n]``, n = output.numel()) of the
        sum (or average) of every rank's ``input``."""
        self._check("reduce_scatter", output=output, input=input)
        self._check_op("reduce_scatter", op)
        if input.numel() != self.world_size * output.numel():
            raise ValueError(
                f"shm reduce_scatter: input has {input.numel()} elements; expected world_size ({self.world_size})"
                f" x output.numel() ({output.numel()}) = {self.world_size * output.numel()}"
            )
        self._handle.reduce_scatter(output.detach(), input.detach(), op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: int = 0) -> None:
        """``output`` = every rank's ``input`` concatenated in rank order. A non-zero ``tag`` labels the call:
        it must be the same on every rank (like the size and dtype), else every rank raises "the ranks called
        different collectives" and ``peer_tags()`` tells what each rank passed."""
        self._check("all_gather", output=output, input=input)
        if output.numel() != self.world_size * input.numel():
            raise ValueError(
                f"shm all_gather: output has {output.numel()} elements; expected world_size ({self.world_size})"
                f" x input.numel() ({input.numel()}) = {self.world_size * input.numel()}"
            )
        self._handle.all_gather_tagged(output.detach(), input.detach(), int(tag))  # untagged: tag 0

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal-split all-to-all: ``output`` piece r (of W equal pieces) = rank r's ``input`` piece ``rank``.
        ``output`` and ``input`` have one size, a multiple of W, and do not overlap."""
        self._check("all_to_all", output=output, input=input)
        if output.numel() != input.numel() or input.numel() % self.world_size:
            raise ValueError(
                f"shm all_to_all: input has {input.numel()} and output {output.numel()} elements; both must be "
                f"one size, a multiple of world_size ({self.world_size})"
            )
        self._handle.all_to_all(output.detach(), input.detach())

    def peer_tags(self) -> list[int]:
        """Every rank's tag for the latest collective (meaningful after a mismatch error; 0: untagged)."""
        return [int(t) for t in self._handle.peer_tags()]

    # -- lifetime ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment (idempotent). Collectives on a closed communicator raise ValueError."""
        if self._handle is not None:
            self._handle.close()

    @property
    def timeout(self) -> float:
        return float(self._handle.timeout())

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._handle.set_timeout(float(seconds))

    def segment_info(self) -> dict[str, int | str]:
        """The segment's name, size, permission bits and owner uid, as fstat saw them (for tests/reports)."""
        h = self._handle
        return {"name": h.name(), "bytes": h.segment_bytes(), "mode": h.mode(), "uid": h.uid()}

    def __repr__(self) -> str:
        state = "closed" if self._handle is None or self._handle.closed() else f"{self._handle.segment_bytes()} B"
        return f"ShmCommunicator(rank={self.rank}, world_size={self.world_size}, {state})"
