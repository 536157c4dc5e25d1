"""tests/conftest.py's order on pytest-xdist workers: slow tests first, file order otherwise; a run without
xdist keeps file order."""

from __future__ import annotations

import pytest

TESTS = """
import pytest

def test_quick_a(): pass

@pytest.mark.slow
def test_slow(): pass

@pytest.mark.slow
def test_slow_b(): pass

def test_quick_b(): pass

@pytest.mark.slow
def test_slow_c(): pass
"""


def _order(pytester: pytest.Pytester) -> list[str]:
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makepyfile(test_order=TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    return [line.split("::")[1] for line in result.outlines if "::" in line]


def test_workers_start_the_slow_tests_first(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    assert _order(pytester) == ["test_slow", "test_slow_b", "test_slow_c", "test_quick_a", "test_quick_b"]


def test_one_process_keeps_file_order(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert _order(pytester) == ["test_quick_a", "test_slow", "test_slow_b", "test_quick_b", "test_slow_c"]
