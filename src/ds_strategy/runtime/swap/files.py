"""Where NVMe offload keeps its bytes: one owner-only directory per process and rank, and files of aligned
regions inside it.

[Note: swap directories]
Every engine that offloads to NVMe makes ``<nvme_path>/ds_strategy_swap/<host>-pid<pid>-rank<rank>-<n>/``
(mode 0700, files 0600: optimizer state is as private as the weights). The directory goes at exit
(``atexit``, and when the engine is destroyed); a process killed before that leaves it behind, so each
start removes the directories of this host whose process is gone. Other hosts' directories (a shared
file system) are left alone: their owners may be alive.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import socket
import stat
from pathlib import Path

import torch

from ds_strategy.ops.aio import ALIGNMENT, AioFile, AioRequest, AsyncIO
from ds_strategy.ops.lock import pid_alive

ROOT_NAME = "ds_strategy_swap"
_counter = itertools.count()


class NvmePathError(ValueError):
    """nvme_path is missing, not a writable directory, or too small for what will be swapped."""


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def remove_stale(root: Path) -> list[Path]:
    """Remove swap directories of this host whose process has exited (see [Note: swap directories])."""
    removed: list[Path] = []
    prefix = _host() + "-pid"
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class SwapDir:
    """This engine's directory of swap files under ``nvme_path`` (see [Note: swap directories])."""

    def __init__(self, nvme_path: str, rank: int, *, key: str, need_bytes: int) -> None:
        base = Path(nvme_path).expanduser()
        if not base.is_dir():
            raise NvmePathError(
                f"zero_optimization.{key}.nvme_path {str(base)!r} does not exist or is not a directory; create it "
                "on a fast local disk (NVMe offload writes its swap files there) or change nvme_path"
            )
        if not os.access(base, os.W_OK | os.X_OK):
            raise NvmePathError(
                f"zero_optimization.{key}.nvme_path {str(base)!r} is not writable by this process (rank {rank}); "
                "choose a directory you can write to"
            )
        root = base / ROOT_NAME
        root.mkdir(mode=0o700, exist_ok=True)
        self.stale_removed = remove_stale(root)
        free = shutil.disk_usage(base).free
        if need_bytes > free:
            raise NvmePathError(
                f"zero_optimization.{key}.nvme_path {str(base)!r} has {free / 2**20:.0f} MiB free but rank {rank} "
                f"needs {need_bytes / 2**20:.0f} MiB of swap files; free space or point nvme_path at a larger disk"
            )
        self.path = root / f"{_host()}-pid{os.getpid()}-rank{rank}-{next(_counter)}"
        self.path.mkdir(mode=0o700)
        os.chmod(self.path, stat.S_IRWXU)
        atexit.register(self.remove)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class SwapFile:
    """One file of ALIGNMENT-aligned regions, one per key, allocated on first use and reused after."""

    def __init__(self, aio: AsyncIO, path: Path) -> None:
        self.aio = aio
        self.path = path
        self.file: AioFile = aio.open(str(path), create=True)
        self.regions: dict[object, tuple[int, int]] = {}  # key -> (offset, capacity in bytes)
        self.end = 0

    def offset(self, key: object, nbytes: int) -> int:
        region = self.regions.get(key)
        if region is None or region[1] < nbytes:
            region = self.regions[key] = (self.end, _align(nbytes))
            self.end += region[1]
        return region[0]

    def has(self, key: object) -> bool:
        return key in self.regions

    def write(self, key: object, tensor: torch.Tensor) -> AioRequest:
        return self.aio.write(tensor, self.file, self.offset(key, tensor.numel() * tensor.element_size()))

    def read(self, key: object, tensor: torch.Tensor) -> AioRequest:
        if key not in self.regions:
            raise KeyError(f"{self.path}: nothing was written for {key!r}")
        return self.aio.read(tensor, self.file, self.regions[key][0])

    def bytes_used(self) -> int:
        return self.end

    def close(self) -> None:
        self.file.close()
