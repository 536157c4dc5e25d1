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

import pytest

from tests import leak_police
from tests.harness import shutdown_pools

pytest_plugins = ["pytester"]  # tests/test_leak_police.py runs a small suite through the fixtures below


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
