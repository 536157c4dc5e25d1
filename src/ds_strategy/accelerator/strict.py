"""The device-strict mode: CPU runs that refuse every collective a GPU backend (NCCL) would refuse.

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
"""

from __future__ import annotations

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
_local = threading.local()  # .object_collective: inside torch's object collectives (exempt)


class DeviceStrictError(RuntimeError):
    """A collective was handed a tensor in host memory under the device-strict mode."""


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

    def on_device(d: Any) -> bool:
        return d is not None and torch.device(d) == strict_device

    class _DeviceFunctions(TorchFunctionMode):
        """``tensor.device`` reads cpu:0 for device memory; ``.to(cpu:0)`` of device memory aliases and
        ``.cpu()`` / ``.to("cpu")`` copies it to (untagged) host memory, as on a GPU;
        ``torch.tensor(..., device=cpu:0)`` is device memory (it bypasses the dispatcher)."""

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
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
