"""Helpers for the launcher's process tests: a free port, the launcher command, and /proc liveness checks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from benchmarks.common import free_port

__all__ = ["LAUNCH", "SCRIPTS", "alive", "free_port", "torchrun", "wait_files", "wait_gone"]

SCRIPTS = Path(__file__).parent / "scripts"
LAUNCH = (sys.executable, "-m", "ds_strategy.launcher")


def torchrun(nproc: int = 2) -> list[str]:
    """torchrun for ``nproc`` local ranks on a port of this worker's range (never the default 29500, which a
    test beside this one may hold)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--master_port={free_port()}", f"--nproc_per_node={nproc}"]


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds ([] when all ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_files(paths: list[Path], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        time.sleep(0.1)
    return False


def env(**extra: str) -> dict[str, str]:
    """The test's environment (PYTHONPATH reaches this tree's ds_strategy) plus ``extra``."""
    import ds_strategy

    out = dict(os.environ)
    out.pop("DS_ENV_FILE", None)
    # Workers must import the ds_strategy under test, wherever pytest found it.
    src = str(Path(ds_strategy.__file__).resolve().parents[1])
    out["PYTHONPATH"] = os.pathsep.join(p for p in (src, out.get("PYTHONPATH", "")) if p)
    out["PYTHONFAULTHANDLER"] = "1"  # a worker dying of a signal prints its Python stack
    out.update(extra)
    return out
