"""Shared fixtures: kernel availability and the harness's pool shutdown at session end."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.harness import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools() -> Iterator[None]:
    yield
    shutdown_pools()


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
