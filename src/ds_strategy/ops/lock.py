"""A build lock that one process per node takes while the others wait, and that never hangs forever.

The lock is a file created with O_EXCL holding ``{"pid", "host", "started"}``. A waiter that finds the
lock held by a dead process on its own host reports it (naming the file) and takes over; a waiter that
cannot tell (another host on a shared file system, or a live holder that takes too long) gives up after
``timeout`` seconds with an error that names the file and its holder, so a killed build never wedges
every later run.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType


class KernelBuildTimeout(RuntimeError):
    """Raised when another process held the build lock longer than the allowed wait."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (someone else's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_holder(path: Path) -> dict[str, object] | None:
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


class BuildLock:
    """Context manager: ``with BuildLock(path, timeout, done=...) as lock: if lock.acquired: build()``.

    ``done`` is polled while waiting: once it returns True (the other process finished the build) the
    waiter returns without the lock and ``acquired`` is False.
    """

    def __init__(self, path: Path, timeout: float, done: Callable[[], bool], poll: float = 0.25) -> None:
        self.path = path
        self.timeout = timeout
        self.done = done
        self.poll = poll
        self.acquired = False

    def __enter__(self) -> BuildLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout
        host = socket.gethostname()
        while not self.done():
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_holder(self.path)
                if holder is None:
                    # Being written right now, or truncated by a crash: judge by age.
                    if self._age() > 10.0:
                        self._remove_stale("an unreadable lock file")
                elif holder.get("host") == host and not pid_alive(int(str(holder.get("pid", 0)))):
                    self._remove_stale(f"process {holder.get('pid')} (dead), started {holder.get('started')}")
                elif time.monotonic() > deadline:
                    raise KernelBuildTimeout(
                        f"waited {self.timeout:.0f}s for the kernel build lock {self.path}, held by pid "
                        f"{holder.get('pid')} on {holder.get('host')} since {holder.get('started')}. If no build "
                        f"is running there, delete {self.path}; set DS_STRATEGY_BUILD_TIMEOUT to wait longer."
                    ) from None
                time.sleep(self.poll)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"pid": os.getpid(), "host": host, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, f)
            self.acquired = True
            break
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.acquired:
            self.path.unlink(missing_ok=True)
            self.acquired = False

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _remove_stale(self, who: str) -> None:
        warnings.warn(
            f"ds_strategy: removing stale kernel build lock {self.path} left by {who}; rebuilding.",
            RuntimeWarning,
            stacklevel=3,
        )
        self.path.unlink(missing_ok=True)
