"""Shared fixtures: kernel availability, the harness's pool shutdown at session end, and leak police.

The leak police (autouse, every test; anchor: Lightning's tests_pytorch/conftest.py) fail a test at
teardown when it leaves behind, in the pytest process itself:

- a non-daemon thread it started that is still alive (it would keep the interpreter from exiting and
  can race the next test);
- an environment variable it set, changed or removed without restoring it (the next test, or a harness
  worker spawned later, would inherit it);
- an initialised default process group (the next in-process test would silently reuse it);
- a replaced ``sys.excepthook`` / ``threading.excepthook``.

The checks live in tests/leak_police.py (``LEAKABLE_ENV`` lists the variables the suite may leave).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from benchmarks.common import PORT_RANGE_ENV

from tests import leak_police
from tests.harness import shutdown_pools

pytest_plugins = ["pytester"]  # tests/test_leak_police.py runs a small suite through the fixtures below


def _worker_port_range() -> str | None:
    """This process's own rendezvous ports, "LO-HI": 1000 ports per pytest-xdist worker from 10000 up, below
    the kernel's ephemeral range (ip_local_port_range) and below the launchers' default 29500, so two tests
    running side by side never pick the same port (benchmarks/common.py ``free_port``). None where that
    does not fit: ports then come from ``bind(0)``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    lo, hi = 10000 + 1000 * index, 11000 + 1000 * index
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return f"{lo}-{hi}" if hi <= min(ephemeral_low, 29000) else None


def pytest_configure(config: pytest.Config) -> None:
    """Before any test (and so before any worker, rank or benchmark it starts, which inherit it)."""
    span = _worker_port_range()
    if span and PORT_RANGE_ENV not in os.environ:
        os.environ[PORT_RANGE_ENV] = span


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist workers (``nox -s tests``), the ``slow`` tests go first (a stable sort: file order
    otherwise), so that none starts late with nothing left to run beside it. Not longest first: the longest
    spawn ranks on every core, and two of them side by side slowed the suite (stop 58's note). Every worker
    sorts alike."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools() -> Iterator[None]:
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    with leak_police.no_leaked_threads():
        yield


@pytest.fixture(autouse=True)
def _no_leaked_env() -> Iterator[None]:
    with leak_police.no_leaked_env():
        yield


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    with leak_police.no_leaked_process_group():
        yield


@pytest.fixture(autouse=True)
def _no_leaked_excepthooks() -> Iterator[None]:
    with leak_police.no_leaked_excepthooks():
        yield


@pytest.fixture(scope="session")
def cpu_kernels() -> bool:
    """Build (or load from the warm cache) the CPU kernels; skip when this machine has no compiler."""
    from ds_strategy.ops import builder

    if builder.compiler() is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here (fallbacks are tested elsewhere)")
    if not builder.load_cpu_kernels():
        pytest.fail("a compiler exists but the CPU kernels did not build; see the warning above")
    return True


def nvcc_path() -> str | None:
    return shutil.which("nvcc")
