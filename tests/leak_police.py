"""Checks that a test leaves the pytest process as it found it (used by autouse fixtures in conftest.py).

Anchor: Lightning's tests_pytorch/conftest.py (thread police, restored environment, process-group
teardown). Each check restores what it can before failing, so one leak is reported once, by the test
that caused it, and does not cascade into the tests after it. Failures are ``pytest.fail`` at teardown:
the offending test errors with a message that names what leaked. A test that initialises a process group
in the pytest process also gets torch's sys.excepthook wrapper, which destroy_process_group leaves in
place: ``monkeypatch.setattr(sys, "excepthook", sys.excepthook)`` first puts the original back at teardown.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import pytest

# Variables a test may leave in the pytest process. Lightning's seed_everything exports its seed for
# workers it might spawn (PL_GLOBAL_SEED, PL_SEED_WORKERS); Lightning's own suite allows them too.
# PYTEST_CURRENT_TEST is pytest's own, rewritten at every phase. Set once per process by an import or a
# first use, so whichever test comes first would be blamed: torch's inductor exports its cache directory
# (TORCHINDUCTOR_CACHE_DIR) at the first compile (opcheck's AOT dispatch test); importing lightning.fabric
# sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (a test that imports Lightning lazily).
LEAKABLE_ENV = frozenset(
    {
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
        "PYTEST_CURRENT_TEST",
        "TORCHINDUCTOR_CACHE_DIR",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
    }
)
THREAD_GRACE_S = 2.0  # a thread that is finishing (joined late by a callback) gets this long to end


@contextlib.contextmanager
def no_leaked_threads() -> Iterator[None]:
    """Non-daemon threads started inside the block must have ended by its end."""
    before = set(threading.enumerate())
    yield
    leaked = []
    for thread in set(threading.enumerate()) - before:
        if thread.daemon:
            continue
        thread.join(THREAD_GRACE_S)
        if thread.is_alive():
            leaked.append(f"{thread.name} (target {getattr(thread, '_target', None)!r})")
    if leaked:
        pytest.fail(f"test left non-daemon thread(s) running: {', '.join(sorted(leaked))}", pytrace=False)


@contextlib.contextmanager
def no_leaked_env(leakable: frozenset[str] = LEAKABLE_ENV) -> Iterator[None]:
    """os.environ at the end of the block equals its start, but for ``leakable`` names."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    leaked = sorted(changed - leakable)
    if not leaked:
        return
    for k in leaked:
        if k in before:
            os.environ[k] = before[k]
        else:
            os.environ.pop(k, None)
    detail = ", ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in leaked)
    pytest.fail(f"test leaked environment variable(s) (restored now): {detail}", pytrace=False)


@contextlib.contextmanager
def no_leaked_process_group() -> Iterator[None]:
    """No default process group may be left initialised in this process by the block."""
    import torch.distributed as dist

    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(
            "test left the default process group initialised in the pytest process (destroyed now)", pytrace=False
        )


@contextlib.contextmanager
def no_leaked_excepthooks() -> Iterator[None]:
    """sys.excepthook and threading.excepthook are the same objects after the block as before it."""
    sys_hook, thread_hook = sys.excepthook, threading.excepthook
    yield
    leaked = []
    if sys.excepthook is not sys_hook:
        leaked.append(f"sys.excepthook ({sys.excepthook!r})")
        sys.excepthook = sys_hook
    if threading.excepthook is not thread_hook:
        leaked.append(f"threading.excepthook ({threading.excepthook!r})")
        threading.excepthook = thread_hook
    if leaked:
        pytest.fail(f"test left a replaced {' and '.join(leaked)} (restored now)", pytrace=False)
