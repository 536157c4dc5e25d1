"""Every environment variable ds_strategy reads, declared once: name, default, meaning, reader.

Modules read them through :func:`get` (at call time: tests and launchers set them per process), never
through ``os.environ`` directly, so this table is the whole list; docs/environment.md is generated from it
(``python -m ds_strategy.env``) and a test fails when the page is stale or a module reads one behind its
back. Torch-free, no ds_strategy imports: the bottom layer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # as the reader interprets "unset"
    meaning: str
    reader: str  # the module that reads it


_VARS: list[EnvVar] = []


def _declare(name: str, default: str, meaning: str, reader: str) -> str:
    _VARS.append(EnvVar(name, default, meaning, reader))
    return name


ACCELERATOR = _declare(
    "DS_ACCELERATOR", "autodetect", "force the accelerator: cuda, cpu or mps (DeepSpeed's name)", "accelerator"
)
DEVICE_STRICT = _declare(
    "DS_STRATEGY_DEVICE_STRICT",
    "off",
    "1/true/yes/on: CPU tensors are tagged as device memory and collectives refuse untagged ones",
    "accelerator/strict.py",
)
LOG_LEVEL = _declare("DS_STRATEGY_LOG_LEVEL", "INFO", "level of the ds_strategy loggers (DEBUG, INFO, ...)", "log.py")
SIMD = _declare(
    "DS_STRATEGY_SIMD",
    "detect",
    "instruction set the CPU kernels are built for (avx512, avx2, neon, scalar)",
    "ops/isa.py",
)
BUILD_TIMEOUT = _declare(
    "DS_STRATEGY_BUILD_TIMEOUT", "900", "seconds to wait for another process's kernel build", "ops/builder.py"
)
REQUIRE_KERNELS = _declare(
    "DS_STRATEGY_REQUIRE_KERNELS", "0", "1: a failed kernel build raises instead of falling back", "ops/builder.py"
)
DISABLE_KERNELS = _declare(
    "DS_STRATEGY_DISABLE_KERNELS", "0", "1: never build kernels; use the pure-torch fallbacks", "ops/builder.py"
)
AIO_BACKEND = _declare(
    "DS_STRATEGY_AIO_BACKEND",
    "auto",
    "I/O backend of the C++ aio engine (NVMe offload): auto (io_uring, else libaio, else blocking), io_uring, "
    "libaio or blocking (pread/pwrite, one request per thread); read when an engine is created",
    "ops/aio.py",
)
DIST_TIMEOUT = _declare(
    "DS_STRATEGY_DIST_TIMEOUT",
    "torch's",
    "seconds of the process group's collective timeout (init_distributed)",
    "comm/distributed.py",
)
EXIT_WAIT = _declare(
    "DS_STRATEGY_EXIT_WAIT",
    "300",
    "seconds a rank waits at a normal exit for its peers before destroying the group (0: no wait)",
    "comm/distributed.py",
)
SHM = _declare(
    "DS_STRATEGY_SHM",
    "1",
    "0/false/no/off: no shared-memory collectives or pipeline channels (torch.distributed only)",
    "comm/collectives.py, comm/shm_channel.py",
)
SHM_ASYNC = _declare(
    "DS_STRATEGY_SHM_ASYNC",
    "1",
    "0/false/no/off: asynchronous shared-memory collectives run inline instead of on a worker thread",
    "comm/collectives.py",
)
SHM_TIMEOUT = _declare(
    "DS_STRATEGY_SHM_TIMEOUT", "1800", "seconds a shared-memory collective waits for its peers", "comm/shm.py"
)
SHM_SLOT_BYTES = _declare(
    "DS_STRATEGY_SHM_SLOT_BYTES", "2097152", "bytes per rank of the shared-memory segment's chunk", "comm/shm.py"
)
SHM_SMALL_BYTES = _declare(
    "DS_STRATEGY_SHM_SMALL_BYTES",
    "65536",
    "all-reduces up to this many bytes take the one-barrier shared-memory path",
    "comm/shm.py",
)
SHM_STREAM_BYTES = _declare(
    "DS_STRATEGY_SHM_STREAM_BYTES",
    "8388608",
    "all-gather outputs from this many bytes are written with streaming stores",
    "csrc/comm/shm_collectives.cpp",
)
GATHER_TIMEOUT = _declare(
    "DS_STRATEGY_GATHER_TIMEOUT",
    "the group's",
    "seconds a stage-3 parameter gather waits before naming the diverged module",
    "runtime/zero/param_gather.py",
)
CKPT_TEST_PAUSE = _declare(
    "DS_STRATEGY_CKPT_TEST_PAUSE",
    "unset",
    "test only: seconds to sleep before each checkpoint file (to kill a save midway)",
    "runtime/checkpoint/format.py",
)
PEAK_TFLOPS = _declare(
    "DS_STRATEGY_PEAK_TFLOPS",
    "the device table",
    "peak dense TFLOPS of one device, for the MFU of the progress line (docs/profiling.md)",
    "profiling/peak.py",
)

VARIABLES: dict[str, EnvVar] = {v.name: v for v in _VARS}


def get(name: str, default: str | None = None) -> str | None:
    """The variable's current value (``default`` when unset); ``name`` must be declared above."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared ds_strategy environment variable (see ds_strategy/env.py)")
    return os.environ.get(name, default)


def is_off(name: str) -> bool:
    """A switch that defaults to on: true when the variable is set to 0, false, no or off (any case)."""
    return (get(name) or "1").strip().lower() in ("0", "false", "no", "off")


def positive_number(name: str, unit: str = "") -> float | None:
    """The variable as a number above 0, None when unset or blank; a ValueError naming the variable and its
    value otherwise. ``unit`` completes the messages ("seconds": "is not a number of seconds")."""
    raw = (get(name) or "").strip()
    if not raw:
        return None
    of = f" of {unit}" if unit else ""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number{of}") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number{of}")
    return value


def markdown_table() -> str:
    rows = ["| variable | default | meaning | read by |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.default} | {v.meaning} | `{v.reader}` |" for v in _VARS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
