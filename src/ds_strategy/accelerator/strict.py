"""The device-strict mode: CPU runs that refuse every collective a GPU backend (NCCL) would refuse, and
every host read of device memory inside a training step (which would synchronise a GPU).

    DS_STRATEGY_DEVICE_STRICT=1 python -m pytest tests/runtime/test_device_strict.py

[Note: device-strict mode]
NCCL takes only device tensors ("No backend type associated with device type cpu"), but on a CPU machine
every tensor is a CPU tensor, so a collective that sends host control data (a label, a flag, a norm), an
offloaded host buffer or a freshly built CPU module works here and fails on the first GPU. The strict
mode tells the two kinds of CPU memory apart the way a GPU would:

* The CPU accelerator's compute device becomes ``torch.device("cpu", 0)`` ("the device"); plain
  ``torch.device("cpu")`` stays "the host".
* A dispatch mode tags as device memory every tensor made by a factory asked for the device, copied there
  with ``.to(device)``, or produced by an op from a tagged input (as placement propagates on a GPU). Tags
  are kept per storage, so views, ``.data`` and ``.detach()`` share them; in-place ops and ``out=`` keep
  the tag their target had. ``tensor.device`` reads ``cpu:0`` for a tagged tensor, so the usual idiom
  ``torch.empty(n, device=param.device)`` allocates device memory exactly as it would on a GPU.
* Every collective is checked where all of them meet: the dispatcher's ``c10d`` / ``_c10d_functional``
  ops (``torch.distributed.all_reduce`` and friends, a ``ProcessGroup`` method called directly,
  functional collectives), plus the shared-memory fast path (``check_collective`` in the Communicator). A
  collective on an untagged tensor raises ``DeviceStrictError`` naming the op, shape and dtype. No code
  path can skip the check: a new collective either goes through the dispatcher or through our
  Communicator. Object collectives (``all_gather_object``, ``broadcast_object_list`` ...) are exempt:
  torch itself puts their byte tensors on the device the backend takes (the current CUDA device for
  NCCL), and barriers carry no data.

The mode is entered once per process, when ``ds_strategy.accelerator`` is first imported with the
variable set, for the main thread (the dispatch and function modes are per thread; collectives and
tensor creation run on the caller's thread, CPU autograd included). With the variable unset nothing is
installed and ``check_collective`` returns at its first test. Under the mode every op runs through Python:
it is a test mode, several times slower.

[Note: host reads inside a step]
On a GPU, reading device memory from the host (``.item()``, ``.tolist()``, ``bool()`` / ``float()`` /
``int()`` / ``if tensor:``, ``.cpu()`` / ``.to("cpu")``, ``.numpy()``, printing it, a copy into
non-pinned host memory, or an op whose output size depends on the data such as ``nonzero``) waits for
every kernel queued before it: the host stops feeding the GPU. A training step should do none (issue 41;
docs/zero3.md, "No host synchronisation in a step"). Under the strict mode the engine brackets its
forward, backward, step and zero_grad with ``no_host_reads(what)`` (from its second optimizer step on:
the first one records stage 3's order), and inside the bracket such a read of device memory raises
``DeviceStrictError`` naming the call site (the first frame outside torch). Reads of host memory are
free. A read that is meant - the one fp16 overflow read per optimizer step, an offloaded optimizer whose
data lives on the host, a report the user asked for - sits inside ``host_read_allowed(reason)``, which
also counts the reads it let through (``allowed_reads()``), so a test can check that there is exactly
one. Without the mode both are no-ops (the engine does not even enter them).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ds_strategy import env

if TYPE_CHECKING:
    import torch

STRICT_ENV = env.DEVICE_STRICT

# True once activate() ran in this process: the flag every check reads first (no cost when False).
ACTIVE = False

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_NOT_DATA = ("barrier", "monitored_barrier_", "wait_tensor")  # carry no user data
_OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)

_tagged: weakref.WeakSet[Any] = weakref.WeakSet()  # storages holding "device memory"
# .object_collective: inside torch's object collectives (exempt); .no_reads: the innermost
# ``no_host_reads`` bracket's description (None outside); .allowed: the innermost ``host_read_allowed``
# reason (None outside); .allowed_counts: reads let through, per reason.
_local = threading.local()
# Ops whose result a GPU can only produce by synchronising with the host (the size of their output, or a
# Python scalar, depends on the data): checked at the dispatcher, which also sees the reads C++ makes.
_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                "unique_consecutive")  # fmt: skip


class DeviceStrictError(RuntimeError):
    """A collective was handed a tensor in host memory, or device memory was read on the host inside a
    step, under the device-strict mode."""


def requested() -> bool:
    """Whether ``$DS_STRATEGY_DEVICE_STRICT`` asks for the mode (1 / true / yes / on)."""
    return (env.get(STRICT_ENV) or "").strip().lower() in ("1", "true", "yes", "on")


def device() -> torch.device:
    """The emulated compute device: ``cpu:0`` (the host is plain ``cpu``)."""
    import torch

    return torch.device("cpu", 0)


def is_device_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is device memory: on a real accelerator, or tagged under the strict mode."""
    if tensor.device.type not in ("cpu", "meta"):
        return True
    return tensor.untyped_storage() in _tagged


def mark_device(tensor: torch.Tensor) -> torch.Tensor:
    """Tag ``tensor``'s storage as device memory (for tests and the mode itself); returns ``tensor``."""
    _tagged.add(tensor.untyped_storage())
    return tensor


def check_collective(op: str, tensors: Any) -> None:
    """Raise ``DeviceStrictError`` when a tensor among ``tensors`` (nested lists allowed) is host memory.

    A no-op unless the strict mode is active."""
    if not ACTIVE or _local.__dict__.get("object_collective", 0):
        return
    for t in _leaves(tensors):
        if not is_device_tensor(t):
            raise DeviceStrictError(
                f"device-strict mode: {op} was given a host tensor (shape {tuple(t.shape)}, {t.dtype}); "
                "a GPU backend such as NCCL refuses CPU tensors. Allocate it on the compute device "
                "(torch.empty(..., device=engine.device) or tensor.to(device)) before the collective; "
                f"see docs/troubleshooting.md ({STRICT_ENV})"
            )


class _Setting:
    """Sets ``_local.<name>`` for a block and puts the previous value back (a class, not a generator context
    manager: entered on every forward, backward and step of a strict run)."""

    __slots__ = ("_name", "_previous", "_value")

    def __init__(self, name: str, value: str) -> None:
        self._name, self._value = name, value
        self._previous: str | None = None

    def __enter__(self) -> None:
        self._previous = _local.__dict__.get(self._name)
        setattr(_local, self._name, self._value)

    def __exit__(self, *exc: object) -> None:
        setattr(_local, self._name, self._previous)


class _Nothing:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NOTHING = _Nothing()  # the do-nothing bracket (the mode is off): no allocation per use


def no_host_reads(what: str) -> Any:
    """Inside: a host read of device memory raises ``DeviceStrictError`` naming the call site (see
    [Note: host reads inside a step]); ``what`` names the bracket in the message. A no-op without the mode."""
    return _Setting("no_reads", what) if ACTIVE else NOTHING


def host_read_allowed(reason: str) -> Any:
    """Inside: host reads are let through (and counted under ``reason``) even within ``no_host_reads``.
    For the reads a step means to make; ``reason`` says which (it is what ``allowed_reads`` reports)."""
    return _Setting("allowed", reason) if ACTIVE else NOTHING


def allowed_reads(reset: bool = False) -> dict[str, int]:
    """Host reads of device memory that ``host_read_allowed`` let through inside ``no_host_reads`` on this
    thread, per reason (``reset``: start counting again)."""
    counts = _local.__dict__.setdefault("allowed_counts", collections.Counter())
    out = dict(counts)
    if reset:
        counts.clear()
    return out


def check_host_read(what: str, tensor: Any) -> None:
    """Raise ``DeviceStrictError`` when ``tensor`` is device memory and this thread is inside
    ``no_host_reads`` (outside ``host_read_allowed``); ``what`` describes the read. A no-op otherwise."""
    if not ACTIVE:
        return
    bracket = _local.__dict__.get("no_reads")
    if bracket is None or not is_device_tensor(tensor):
        return
    reason = _local.__dict__.get("allowed")
    if reason is not None:
        _local.__dict__.setdefault("allowed_counts", collections.Counter())[reason] += 1
        return
    raise DeviceStrictError(
        f"device-strict mode: host read inside {bracket}: {what} of a device tensor (shape "
        f"{tuple(tensor.shape)}, {tensor.dtype}) at {_call_site()}. On a GPU this synchronises the host with "
        "the device; keep the value on the device (torch.where, torch.clamp, a tensor argument), or wrap a "
        "read that is meant in ds_strategy.accelerator.strict.host_read_allowed(reason); see "
        f"docs/zero3.md, No host synchronisation in a step ({STRICT_ENV})"
    )


def _call_site() -> str:
    """``file:line in function`` of the innermost frame outside torch and this module."""
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    here = os.path.abspath(__file__)
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(torch_dir) and os.path.abspath(name) != here and "contextlib" not in name:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def activate() -> None:
    """Enter the strict mode for this process (idempotent): tag device memory, check every collective."""
    global ACTIVE
    if ACTIVE:
        return
    import torch
    import torch.distributed.distributed_c10d as c10d
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode, _push_mode

    strict_device = device()
    device_getter = torch.Tensor.device.__get__
    to, cpu, host = torch.Tensor.to, torch.Tensor.cpu, torch.device("cpu")
    constructors = (torch.tensor, torch.as_tensor, torch.asarray)
    copy_ = torch.Tensor.copy_
    T = torch.Tensor
    # Tensor methods that hand device data to the host (see [Note: host reads inside a step]).
    reads = {
        T.item: ".item()", T.tolist: ".tolist()", T.__bool__: "bool()", T.__float__: "float()",
        T.__int__: "int()", T.__index__: "an index (__index__)", T.__complex__: "complex()",
        T.numpy: ".numpy()", T.__array__: "numpy.asarray()", T.__repr__: "repr()", T.__format__: "format()",
    }  # fmt: skip

    def on_device(d: Any) -> bool:
        return d is not None and torch.device(d) == strict_device

    class _DeviceFunctions(TorchFunctionMode):
        """``tensor.device`` reads cpu:0 for device memory; ``.to(cpu:0)`` of device memory aliases and
        ``.cpu()`` / ``.to("cpu")`` copies it to (untagged) host memory, as on a GPU;
        ``torch.tensor(..., device=cpu:0)`` is device memory (it bypasses the dispatcher)."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if _local.__dict__.get("no_reads") is not None and args and isinstance(args[0], torch.Tensor):
                read = reads.get(func)
                if read is not None:
                    check_host_read(f"Tensor{read}" if read.startswith(".") else read, args[0])
                    _local.in_read = True  # the dispatcher's _local_scalar_dense below is this read
                    try:
                        return func(*args, **kwargs)
                    finally:
                        _local.in_read = False
                elif (
                    func is copy_
                    and len(args) > 1
                    and isinstance(args[1], torch.Tensor)
                    and not is_device_tensor(args[0])
                    and not _pinned(args[0])
                ):
                    check_host_read("a copy into non-pinned host memory (Tensor.copy_)", args[1])
            if func == device_getter:
                out = func(*args, **kwargs)
                return strict_device if out.type == "cpu" and is_device_tensor(args[0]) else out
            if func is to and len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): its device
                other = args[1]
                args = (args[0], strict_device if is_device_tensor(other) else host, other.dtype, *args[2:])
            if (func is to or func is cpu) and args and is_device_tensor(args[0]):
                parsed = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to does not take it
                target = host if func is cpu else torch._C._nn._parse_to(*args[1:], **parsed)[0]
                if on_device(target):  # device to device: an alias, or a copy (copy=True, a new dtype) on the device
                    new_args, new_kwargs = _retarget(args, kwargs, host)
                    return mark_device(func(*new_args, **new_kwargs))
                if target == host:
                    check_host_read("Tensor.cpu()" if func is cpu else "Tensor.to(host)", args[0])
                out = func(*args, **kwargs)
                if target == host and not out.requires_grad and out.untyped_storage() is args[0].untyped_storage():
                    return torch.empty_like(out, device=host).copy_(out)  # to the host: a copy, as from a GPU
                return out
            out = func(*args, **kwargs)
            if func in constructors and on_device(kwargs.get("device")) and isinstance(out, torch.Tensor):
                mark_device(out)
            return out

    class _DeviceTags(TorchDispatchMode):
        """Tags the outputs of factories for the device and of ops on device memory; checks collectives."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func.namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NOT_DATA:
                check_collective(f"torch.distributed collective {func.name()}", (args, kwargs))
            elif (
                func._opname in _SYNCING_OPS
                and _local.__dict__.get("no_reads") is not None
                and not _local.__dict__.get("in_read")
                and args
            ):
                if isinstance(args[0], torch.Tensor):
                    check_host_read(f"{func.name()} (its result is read on the host)", args[0])
            elif func._opname in ("index", "index_put", "index_put_") and _local.__dict__.get("no_reads") is not None:
                masks = [i for i in (args[1] if len(args) > 1 else ()) if isinstance(i, torch.Tensor)]
                mask = next((i for i in masks if i.dtype in (torch.bool, torch.uint8)), None)
                if mask is not None:  # a boolean mask becomes indices through nonzero
                    check_host_read(f"{func.name()} with a boolean mask (nonzero on the host)", mask)
            out = func(*args, **kwargs)
            target = kwargs.get("device")
            tag = on_device(target) if target is not None else any(is_device_tensor(t) for t in _leaves(args))
            if tag:
                inputs = {id(t.untyped_storage()) for t in _leaves((args, kwargs))}
                for t in _leaves(out):
                    if id(t.untyped_storage()) not in inputs:  # an in-place op keeps its target's tag
                        mark_device(t)
            return out

    for name in _OBJECT_COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is not None:
            wrapped = _exempt(original)
            setattr(c10d, name, wrapped)
            if getattr(torch.distributed, name, None) is original:
                setattr(torch.distributed, name, wrapped)

    functions = _DeviceFunctions()
    _run_backward_with(functions)
    _push_mode(_DeviceTags())
    torch._C._push_on_torch_function_stack(functions)
    ACTIVE = True


def _pinned(tensor: torch.Tensor) -> bool:
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:  # no accelerator to ask
        return False


def _run_backward_with(mode: Any) -> None:
    """Keep the function mode on during backward: ``Tensor.backward`` reaches the autograd engine from inside
    the mode's handler, where torch has popped the mode, and the gradient hooks (which allocate buckets
    with ``device=param.device``) would otherwise run without it."""
    import torch.autograd
    from torch.overrides import _get_current_function_mode_stack

    original = torch.autograd._engine_run_backward

    def engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        if any(m is mode for m in _get_current_function_mode_stack()):
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    torch.autograd._engine_run_backward = engine_run_backward


def _exempt(fn: Any) -> Any:
    import functools

    @functools.wraps(fn)
    def object_collective(*args: Any, **kwargs: Any) -> Any:
        _local.object_collective = getattr(_local, "object_collective", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _local.object_collective -= 1

    return object_collective


def _retarget(args: Any, kwargs: Any, host: torch.device) -> tuple[Any, Any]:
    """``Tensor.to`` arguments with the strict device replaced by the host (same storage: an alias)."""
    import torch

    def swap(v: Any) -> Any:
        if isinstance(v, (str, torch.device)) and torch.device(v).type == "cpu":
            return host
        return v

    new_args = (args[0], *(swap(a) for a in args[1:]))
    new_kwargs = {k: swap(v) if k == "device" else v for k, v in kwargs.items()}
    return new_args, new_kwargs


def _leaves(value: Any) -> Iterator[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
