"""Asynchronous file I/O between CPU tensors and files: the engine under NVMe offload (ZeRO-Infinity).

An :class:`AsyncIO` engine moves the bytes of a contiguous CPU tensor to or from a file at a byte offset,
in the background: :meth:`AsyncIO.read` and :meth:`AsyncIO.write` split the tensor into ``block_size``
blocks, hand them to ``thread_count`` worker threads and return an :class:`AioRequest` to wait on. At most
2 x ``queue_depth`` x ``thread_count`` blocks are in flight per engine (queued or being transferred: a
queue_depth of blocks waits behind each thread's transfers, so a finished one is replaced at once); a
submitter that finds the queue full blocks until a block completes, so a large request never grows memory.

Two backends do the same work, block for block:

- ``"kernel"``: the C++ engine (csrc/aio/), used when the compiled CPU kernels load
  (:func:`ds_strategy.ops.builder.load_cpu_kernels`). Each worker keeps up to ``queue_depth`` blocks
  outstanding at the device through io_uring or Linux AIO, whichever the build found (liburing, libaio),
  else runs one blocking pread/pwrite at a time: :func:`backend` says which, ``DS_STRATEGY_AIO_BACKEND``
  forces one. Waiting releases the GIL, so Python threads keep running during I/O.
- ``"python"``: a ``ThreadPoolExecutor`` issuing ``os.preadv`` / ``os.pwrite`` (which release the GIL,
  one transfer per thread at a time) with a semaphore of 2 x ``queue_depth`` x ``thread_count`` slots.

Files are opened with ``O_DIRECT`` when the file system allows it (ext4, xfs: the page cache is
bypassed, as ZeRO-Infinity wants for swap files), else buffered (tmpfs refuses ``O_DIRECT``). O_DIRECT
needs the memory address, the file offset and the length of every transfer to be multiples of
:data:`ALIGNMENT`; the engine takes care of it per request:

- tensor address and file offset aligned: direct transfers straight into / out of the tensor;
- address not aligned, offset aligned: direct transfers through an aligned staging buffer of
  ``block_size`` bytes per outstanding transfer (one extra memcpy per block);
- offset not aligned: buffered transfers (a second, buffered descriptor of the same file);
- a length that is not a multiple of ALIGNMENT: the aligned prefix as above, the tail buffered.

Linux keeps the two descriptors coherent (a direct transfer writes back and drops cached pages of its
range). :func:`aligned_empty` allocates tensors that always take the first path.

Requests that fail raise :class:`AioError` from :meth:`AioRequest.wait`, naming the operation, block size,
offset and path; a read that meets the end of the file early is an error too (a short read).
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import mmap
import os
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any

import torch

from ds_strategy import env

ALIGNMENT = 4096  # bytes: the O_DIRECT unit (logical block size) of the file systems we target

_DIRECT, _BOUNCE, _BUFFERED = 0, 1, 2  # how one block is transferred (csrc/aio/aio_engine.h: Mode)
_Block = tuple[int, int, int, int]  # (tensor byte start, length, file offset, mode)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements whose data pointer is ALIGNMENT-aligned and
    whose storage extends to the next multiple of ALIGNMENT bytes, so O_DIRECT transfers need no staging.
    ``pin``: page-locked (CUDA's pinned host memory; needs CUDA).

    Over-allocates a uint8 tensor by ALIGNMENT bytes and views it from its first aligned byte (pinned
    allocations are not promised to be page-aligned either, so the same slicing serves both).
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    padded = max(_round_up(numel * itemsize, ALIGNMENT), ALIGNMENT)
    raw = torch.empty(padded + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGNMENT
    return raw[start : start + padded].view(dtype)[:numel]


def io_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A staging buffer between a swap file and the device, ALIGNMENT-aligned and padded like
    :func:`aligned_empty`: page-locked when CUDA is available (copies to and from the device then run as
    DMA, and a host-to-device copy can be asynchronous); otherwise an anonymous memory mapping of its own,
    outside glibc's heap. Swap buffers of a few MiB, kept while their transfers are in flight, sit below
    the mmap threshold (8 MiB, [Note: host memory under NVMe offload]) and fragmented the heap: measured,
    the 32-layer GPT of bench_nvme peaked 190 MiB higher per rank with them on the heap."""
    if torch.cuda.is_available():
        return aligned_empty(numel, dtype, pin=True)
    if numel < 0:
        raise ValueError(f"io_buffer: numel must be >= 0, got {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    padded = max(_round_up(numel * itemsize, ALIGNMENT), ALIGNMENT)
    region = mmap.mmap(-1, padded)  # page-aligned; unmapped when the last tensor over it goes
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype)[:numel]


# -- options ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AioOptions:
    """What the engine reads of the ds_config ``"aio"`` block, and what each key means for it.

    The values are taken as validated: the block is checked once, by ``ds_strategy.config.AioConfig``
    (positive integers, ``block_size`` a multiple of ALIGNMENT, DeepSpeed's ``intra_op_parallelism`` for
    ``thread_count``, ``use_gds`` refused); nothing here checks them again.

    - ``block_size``: bytes per transfer (one read or write request per block); a multiple of ALIGNMENT.
    - ``queue_depth``: blocks each worker keeps outstanding at the device at once (io_uring / Linux AIO;
      the blocking backend has one); the engine holds at most 2 x ``queue_depth`` x ``thread_count`` blocks
      in flight (queued + transferring), and submitters block beyond it.
    - ``thread_count``: worker threads issuing the transfers (DeepSpeed's ``intra_op_parallelism``).
    - ``single_submit``: True queues blocks one at a time, each after waiting for a free slot, and issues
      them to the kernel one system call each; False (default) queues every block that fits in the free
      slots at once and issues a worker's new blocks with one ``io_uring_submit`` / ``io_submit``.
    - ``overlap_events``: True (default) returns from read/write as soon as the blocks are queued, so the
      caller overlaps I/O with its own work; False completes the request before read/write returns.
    """

    block_size: int = 1048576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @classmethod
    def from_config(cls, aio: Mapping[str, Any] | object | None) -> AioOptions:
        """Options from a validated ``aio`` block: a ``ds_strategy.config.AioConfig`` (its ``threads``: the
        thread count whichever name the config used), a mapping of these field names (what the engine
        passes), or None (every default). A DeepSpeed ``aio`` dict is validated first:
        ``AioOptions.from_config(AioConfig.from_block(block))``."""
        if aio is None:
            return cls()
        names = [f.name for f in fields(cls)]
        if isinstance(aio, Mapping):
            foreign = sorted(set(aio) - set(names))
            if foreign:
                raise TypeError(
                    f"AioOptions.from_config takes a validated block with the keys {', '.join(sorted(names))}; "
                    f"got {', '.join(foreign)}: pass ds_strategy.config.AioConfig.from_block(block) instead"
                )
            return cls(**aio)
        # An AioConfig: its values by name, the thread count as the config resolved it (under either name).
        config: Any = aio
        return cls(**{**{name: getattr(config, name) for name in names}, "thread_count": config.threads})


# -- errors ----------------------------------------------------------------------------------------------


class AioError(OSError):
    """A block of a request failed: ``str()`` names the operation, bytes, offset and path; ``.errno`` and
    ``.filename`` are set (``errno.EIO`` for a short read)."""

    def __init__(self, message: str, *, code: int, filename: str) -> None:
        super().__init__(code, os.strerror(code), filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _aio_error(is_write: bool, path: str, failure: tuple[int, int, int, int]) -> AioError:
    code, nbytes, offset, got = failure
    op, prep = ("write", "to") if is_write else ("read", "from")
    if got >= 0:
        reason = f"short {op} ({'wrote' if is_write else 'got'} {got} bytes)"
    else:
        reason = f"{os.strerror(code)} (errno {code})"
    return AioError(
        f"aio {op} of {nbytes} bytes at offset {offset} {prep} {path} failed: {reason}", code=code, filename=path
    )


# -- files -----------------------------------------------------------------------------------------------


class AioFile:
    """A file opened for the engine (:meth:`AsyncIO.open`). ``fd`` is the descriptor of direct transfers
    (``O_DIRECT`` when ``direct``); unaligned transfers use a second, buffered descriptor of the file."""

    def __init__(self, path: str | os.PathLike[str], create: bool = False) -> None:
        self.path = os.fspath(path)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        direct_flag = getattr(os, "O_DIRECT", 0)
        self.direct = False
        fd = -1
        if direct_flag:
            try:
                fd = os.open(self.path, flags | direct_flag, 0o600)
                self.direct = True
            except OSError as err:
                if err.errno != errno_codes.EINVAL:  # EINVAL: this file system refuses O_DIRECT
                    raise
        if fd < 0:
            fd = os.open(self.path, flags, 0o600)
        self.fd = fd
        try:
            if create:
                os.fchmod(fd, 0o600)  # owner-only even if the file existed, whatever the umask
            self.buffered_fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC) if self.direct else fd
        except BaseException:
            os.close(fd)
            raise
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.buffered_fd != self.fd:
            os.close(self.buffered_fd)
        os.close(self.fd)

    def __enter__(self) -> AioFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AioFile({self.path!r}, direct={self.direct}{', closed' if self.closed else ''})"


def _plan(address: int, nbytes: int, offset: int, direct: bool, block_size: int) -> list[_Block]:
    """(tensor byte start, length, file offset, mode) of every block of a request; the C++ engine's
    plan_blocks (csrc/aio/aio_engine.cpp) makes the same plan."""
    if direct and offset % ALIGNMENT == 0:
        body = nbytes - nbytes % ALIGNMENT
        mode = _DIRECT if address % ALIGNMENT == 0 else _BOUNCE
    else:
        body, mode = 0, _BUFFERED
    blocks = [(s, min(block_size, body - s), offset + s, mode) for s in range(0, body, block_size)]
    blocks += [(s, min(block_size, nbytes - s), offset + s, _BUFFERED) for s in range(body, nbytes, block_size)]
    return blocks


# -- the pure-Python backend -----------------------------------------------------------------------------


def _transfer(fd: int, address: int, length: int, offset: int, is_write: bool, direct: bool) -> int:
    """pwrite/pread ``length`` bytes at ``address``; the bytes moved (< length: end of file / no room).
    Interrupted calls are retried by Python itself (PEP 475). On an O_DIRECT descriptor a partial
    transfer ending unaligned is final (the rest would fail with EINVAL; it only happens at the end)."""
    done = 0
    while done < length:
        buffer = (ctypes.c_ubyte * (length - done)).from_address(address + done)
        n = os.pwrite(fd, buffer, offset + done) if is_write else os.preadv(fd, [buffer], offset + done)
        if n == 0:
            break
        done += n
        if direct and done % ALIGNMENT:
            break
    return done


class _PyRequest:
    def __init__(self, blocks: int, tensor: torch.Tensor) -> None:
        self.remaining = blocks
        self.failure: tuple[int, int, int, int] | None = None
        self.tensor: torch.Tensor | None = tensor  # alive until every block is done
        self.event = threading.Event()
        if blocks == 0:
            self.event.set()

    def wait(self) -> tuple[int, int, int, int] | None:
        self.event.wait()
        return self.failure

    def done(self) -> bool:
        return self.event.is_set()


class _PythonBackend:
    def __init__(self, options: AioOptions) -> None:
        self._options = options
        self._pool = ThreadPoolExecutor(options.thread_count, thread_name_prefix="ds_strategy-aio")
        self._slots = threading.Semaphore(2 * options.queue_depth * options.thread_count)  # as the C++ engine
        self._lock = threading.Lock()
        self._local = threading.local()
        self._transferred: set[int] = set()  # threads that ran a transfer (each one at a time)
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def device_max_in_flight(self) -> list[int]:
        ran = len(self._transferred)
        return [1] * ran + [0] * (self._options.thread_count - ran)

    def _staging(self) -> int:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = aligned_empty(self._options.block_size, torch.uint8)
        return int(staging.data_ptr())

    def _run(
        self, request: _PyRequest, address: int, block: tuple[int, int, int, int], file: AioFile, is_write: bool
    ) -> None:
        start, length, offset, mode = block
        try:
            if request.failure is None:  # a failed request skips its remaining blocks
                self._transferred.add(threading.get_ident())
                fd = file.buffered_fd if mode == _BUFFERED else file.fd
                if mode == _BOUNCE:
                    staging = self._staging()
                    if is_write:
                        ctypes.memmove(staging, address + start, length)
                    got = _transfer(fd, staging, length, offset, is_write, True)
                    if not is_write:
                        ctypes.memmove(address + start, staging, got)
                else:
                    got = _transfer(fd, address + start, length, offset, is_write, mode == _DIRECT)
                if got < length:
                    self._fail(request, (errno_codes.EIO, length, offset, got))
        except OSError as err:
            self._fail(request, (err.errno or errno_codes.EIO, length, offset, -1))
        finally:
            with self._lock:
                self.in_flight -= 1
                request.remaining -= 1
                finished = request.remaining == 0
                if finished:
                    request.tensor = None
            self._slots.release()
            if finished:
                request.event.set()

    def _fail(self, request: _PyRequest, failure: tuple[int, int, int, int]) -> None:
        with self._lock:
            if request.failure is None:
                request.failure = failure

    def submit(self, tensor: torch.Tensor, file: AioFile, offset: int, is_write: bool) -> _PyRequest:
        address = tensor.data_ptr()
        blocks = _plan(address, tensor.nbytes, offset, file.direct, self._options.block_size)
        request = _PyRequest(len(blocks), tensor)
        i = 0
        while i < len(blocks):
            self._slots.acquire()  # blocks while queue_depth blocks are in flight
            taken = 1
            if not self._options.single_submit:  # a batch: every block that fits in the free slots
                while i + taken < len(blocks) and self._slots.acquire(blocking=False):
                    taken += 1
            with self._lock:
                self.in_flight += taken
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            for block in blocks[i : i + taken]:
                self._pool.submit(self._run, request, address, block, file, is_write)
            i += taken
        return request

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# -- the C++ backend -------------------------------------------------------------------------------------


_IO_BACKENDS = ("auto", "io_uring", "libaio", "blocking")


def _requested() -> str:
    """DS_STRATEGY_AIO_BACKEND, read when an engine is created (tests and benchmarks switch it per engine)."""
    raw = env.get(env.AIO_BACKEND) or ""
    name = raw.strip().lower() or "auto"
    if name not in _IO_BACKENDS:
        expected = ", ".join(_IO_BACKENDS)
        raise ValueError(f"{env.AIO_BACKEND}={raw!r}: not an I/O backend of the aio engine; expected one of {expected}")
    return name


def compiled_backends() -> list[str]:
    """The I/O backends the C++ engine was built with, best first (``["io_uring", "libaio", "blocking"]``
    with both libraries found at build time); ``[]`` when the CPU kernels do not load."""
    from ds_strategy.ops.builder import load_cpu_kernels

    if not load_cpu_kernels():
        return []
    return [str(name) for name in torch.classes.ds_strategy.AioEngine.compiled_backends()]


def backend() -> str:
    """How a new :class:`AsyncIO` reaches the device here: ``"io_uring"`` or ``"libaio"`` (each worker keeps
    ``queue_depth`` transfers outstanding), ``"blocking"`` (the C++ engine's pread/pwrite fallback: no
    library at build time, the kernel refused both, or ``DS_STRATEGY_AIO_BACKEND=blocking``) or
    ``"python"`` (no compiled kernels). Sets up, and drops, a one-thread engine to find out."""
    if not compiled_backends():
        return "python"
    probe = torch.classes.ds_strategy.AioEngine(ALIGNMENT, 1, 1, False, _requested())
    try:
        return str(probe.backend())
    finally:
        probe.close()


class _KernelRequest:
    def __init__(self, engine: Any, request_id: int) -> None:
        self._engine = engine
        self._id = request_id
        self._result: tuple[int, int, int, int] | None = None
        self._waited = False
        self._lock = threading.Lock()

    def wait(self) -> tuple[int, int, int, int] | None:
        with self._lock:
            if not self._waited:
                code, nbytes, offset, got = self._engine.wait(self._id)  # GIL released while it blocks
                self._result = (code, nbytes, offset, got) if code else None
                self._waited = True
            return self._result

    def done(self) -> bool:
        return self._waited or bool(self._engine.done(self._id))


class _KernelBackend:
    def __init__(self, options: AioOptions) -> None:
        self._engine = torch.classes.ds_strategy.AioEngine(
            options.block_size, options.queue_depth, options.thread_count, options.single_submit, _requested()
        )
        self.io_backend = str(self._engine.backend())
        self._device_max: list[int] | None = None  # kept at close: the engine's counters go with it

    @property
    def device_max_in_flight(self) -> list[int]:
        if self._device_max is not None:
            return self._device_max
        return [int(n) for n in self._engine.device_max_in_flight()]

    @property
    def in_flight(self) -> int:
        return int(self._engine.in_flight())

    @property
    def max_in_flight(self) -> int:
        return int(self._engine.max_in_flight())

    def submit(self, tensor: torch.Tensor, file: AioFile, offset: int, is_write: bool) -> _KernelRequest:
        request_id = self._engine.submit(tensor, file.fd, file.buffered_fd, offset, is_write, file.direct)
        return _KernelRequest(self._engine, request_id)

    def close(self) -> None:
        self._device_max = self.device_max_in_flight
        self._engine.close()


# -- the public engine -----------------------------------------------------------------------------------


class AioRequest:
    """One read or write in flight. :meth:`wait` returns when every block is done and raises
    :class:`AioError` for the first block that failed; :meth:`done` says whether it is complete."""

    def __init__(
        self, pending: _PyRequest | _KernelRequest, is_write: bool, path: str, offset: int, owner: AsyncIO
    ) -> None:
        self._pending = pending
        self._is_write = is_write
        self._path = path
        self._offset = offset
        self._owner = owner

    def wait(self) -> None:
        failure = self._pending.wait()
        self._owner._forget(self, self._is_write, self._path, self._offset)
        if failure is not None:
            raise _aio_error(self._is_write, self._path, failure)

    def done(self) -> bool:
        return self._pending.done()


class AsyncIO:
    """An asynchronous I/O engine: ``thread_count`` workers, each with up to ``queue_depth`` blocks at the
    device.

    ``backend``: ``"kernel"`` (the C++ engine), ``"python"``, or None for ``"kernel"`` when the compiled
    CPU kernels load and ``"python"`` otherwise. The chosen one is the ``backend`` attribute; how its
    workers reach the device (``"io_uring"``, ``"libaio"``, ``"blocking"``) is ``io_backend``.
    Use as a context manager, or call :meth:`close` (it waits for every request).
    """

    def __init__(self, options: AioOptions | None = None, backend: str | None = None) -> None:
        self.options = options or AioOptions()
        if backend is None:
            from ds_strategy.ops.builder import load_cpu_kernels

            backend = "kernel" if load_cpu_kernels() else "python"
        elif backend == "kernel":
            from ds_strategy.ops.builder import load_cpu_kernels

            if not load_cpu_kernels():
                raise RuntimeError(
                    "AsyncIO(backend='kernel'): the CPU kernels are not available here; use backend='python' or None"
                )
        elif backend != "python":
            raise ValueError(f"AsyncIO: backend must be 'kernel', 'python' or None, got {backend!r}")
        self.backend = backend
        self._impl: _PythonBackend | _KernelBackend = (
            _KernelBackend(self.options) if backend == "kernel" else _PythonBackend(self.options)
        )
        # How the workers reach the device: "io_uring", "libaio" or "blocking" (one transfer per thread).
        self.io_backend = self._impl.io_backend if isinstance(self._impl, _KernelBackend) else "blocking"
        self._outstanding: dict[int, AioRequest] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Counters (tests, benchmarks): requests issued, and requests waited for after they completed.
        self.issued = {"read": 0, "write": 0}
        self.completed = {"read": 0, "write": 0}
        # Test hook: set to a list to record ("issue" | "done", "read" | "write", path, offset) in order, so a
        # test proves overlap without timing (a read issued before the compute that needs it).
        self.events: list[tuple[str, str, str, int]] | None = None

    # Test hooks: blocks queued or transferring now, and the most there have been.
    @property
    def in_flight(self) -> int:
        return self._impl.in_flight

    @property
    def max_in_flight(self) -> int:
        return self._impl.max_in_flight

    @property
    def device_max_in_flight(self) -> list[int]:
        """Per worker thread: the most transfers it had outstanding at the device at once (at most
        ``queue_depth``; 1 on the blocking paths), since the engine was created."""
        return self._impl.device_max_in_flight

    def open(self, path: str | os.PathLike[str], create: bool = False) -> AioFile:
        """Open ``path`` read-write (``create``: create it if missing, mode 0o600; never truncates)."""
        return AioFile(path, create=create)

    def read(self, tensor: torch.Tensor, file: AioFile, offset: int) -> AioRequest:
        """Fill contiguous CPU ``tensor`` with ``tensor.nbytes`` bytes of ``file`` from byte ``offset``."""
        return self._submit(tensor, file, offset, is_write=False)

    def write(self, tensor: torch.Tensor, file: AioFile, offset: int) -> AioRequest:
        """Write the bytes of contiguous CPU ``tensor`` to ``file`` at byte ``offset``. The tensor must not
        change until the request is done."""
        return self._submit(tensor, file, offset, is_write=True)

    def _submit(self, tensor: torch.Tensor, file: AioFile, offset: int, is_write: bool) -> AioRequest:
        op = "write" if is_write else "read"
        if self._closed:
            raise RuntimeError(f"aio {op}: the engine is closed")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"aio {op}: expected a contiguous CPU tensor, got {_describe(tensor)}")
        if file.closed:
            raise ValueError(f"aio {op}: {file.path} is closed")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"aio {op}: offset must be a non-negative integer, got {offset!r}")
        pending = self._impl.submit(tensor, file, offset, is_write)
        request = AioRequest(pending, is_write, file.path, offset, self)
        with self._lock:
            self._outstanding[id(request)] = request
            self.issued[op] += 1
            if self.events is not None:
                self.events.append(("issue", op, file.path, offset))
        if not self.options.overlap_events:
            request.wait()
        return request

    def _forget(self, request: AioRequest, is_write: bool, path: str, offset: int) -> None:
        with self._lock:
            if self._outstanding.pop(id(request), None) is not None:  # the first wait of the request
                op = "write" if is_write else "read"
                self.completed[op] += 1
                if self.events is not None:
                    self.events.append(("done", op, path, offset))

    def wait_all(self) -> None:
        """Wait for every request not yet waited for; raise the first :class:`AioError` among them."""
        with self._lock:
            requests = list(self._outstanding.values())
        first: AioError | None = None
        for request in requests:
            try:
                request.wait()
            except AioError as err:
                first = first or err
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for every request (errors of requests nobody waited for are warned about) and stop the
        worker threads. Files are the caller's to close."""
        if self._closed:
            return
        try:
            self.wait_all()
        except AioError as err:
            warnings.warn(f"aio: a request nobody waited for failed: {err}", RuntimeWarning, stacklevel=2)
        finally:
            self._closed = True
            self._impl.close()

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AsyncIO(backend={self.backend!r}, io_backend={self.io_backend!r}, {self.options})"


def _describe(tensor: object) -> str:
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    return f"a tensor on {tensor.device}{'' if tensor.is_contiguous() else ' (not contiguous)'}"
