"""The leak police of conftest.py: each leak fails the test that caused it, names it, and is undone."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import leak_police

REPO = Path(__file__).resolve().parents[1]


def test_a_leaked_non_daemon_thread_is_named() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="planted-leaker")
    try:
        with (
            pytest.raises(pytest.fail.Exception, match=r"non-daemon thread.*planted-leaker"),
            leak_police.no_leaked_threads(),
        ):
            thread.start()
    finally:
        stop.set()
        thread.join()


def test_daemon_and_finished_threads_pass() -> None:
    stop = threading.Event()
    daemon = threading.Thread(target=stop.wait, daemon=True)
    try:
        with leak_police.no_leaked_threads():
            daemon.start()
            done = threading.Thread(target=lambda: None)
            done.start()
    finally:
        stop.set()
        daemon.join()


def test_a_leaked_env_variable_is_named_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_TEST_POLICE_CHANGED", "before")
    monkeypatch.setenv("DS_TEST_POLICE_REMOVED", "there")
    monkeypatch.delenv("DS_TEST_POLICE_ADDED", raising=False)
    with pytest.raises(pytest.fail.Exception) as failure, leak_police.no_leaked_env():
        os.environ["DS_TEST_POLICE_ADDED"] = "1"
        os.environ["DS_TEST_POLICE_CHANGED"] = "after"
        del os.environ["DS_TEST_POLICE_REMOVED"]
    message = str(failure.value)
    for name in ("DS_TEST_POLICE_ADDED", "DS_TEST_POLICE_CHANGED", "DS_TEST_POLICE_REMOVED"):
        assert name in message
    assert "DS_TEST_POLICE_ADDED" not in os.environ
    assert os.environ["DS_TEST_POLICE_CHANGED"] == "before"
    assert os.environ["DS_TEST_POLICE_REMOVED"] == "there"


def test_allowed_env_variables_may_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    with leak_police.no_leaked_env():
        os.environ["PL_GLOBAL_SEED"] = "3"
    assert os.environ["PL_GLOBAL_SEED"] == "3"  # monkeypatch removes it again


def test_a_leaked_process_group_is_named_and_destroyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # init_process_group wraps sys.excepthook (and never unwraps it): monkeypatch puts the original back.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    assert not dist.is_initialized()
    with (
        pytest.raises(pytest.fail.Exception, match="default process group initialised"),
        leak_police.no_leaked_process_group(),
    ):
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_a_leaked_excepthook_is_named_and_restored() -> None:
    original_sys, original_threading = sys.excepthook, threading.excepthook
    with (
        pytest.raises(pytest.fail.Exception, match=r"sys\.excepthook.*threading\.excepthook"),
        leak_police.no_leaked_excepthooks(),
    ):
        sys.excepthook = lambda *a: None
        threading.excepthook = lambda a: None
    assert sys.excepthook is original_sys
    assert threading.excepthook is original_threading


LEAKY_SUITE = """
import os, sys, threading
import pytest

stop = threading.Event()


def test_thread():
    threading.Thread(target=stop.wait, name="inner-leaker").start()


def test_env():
    os.environ["DS_TEST_INNER_LEAK"] = "1"


def test_hook():
    sys.excepthook = lambda *a: None


def test_clean_after_the_leaks():
    stop.set()
    assert "DS_TEST_INNER_LEAK" not in os.environ and sys.excepthook is sys.__excepthook__
"""


def test_the_fixtures_fail_the_offending_tests(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real conftest's fixtures, in a suite of its own (a subprocess: its leaks stay there).
    pytester.makeconftest(
        "from tests.conftest import *  # noqa: F403\nfrom tests.conftest import (\n"
        "    _no_leaked_env, _no_leaked_excepthooks, _no_leaked_process_group, _no_leaked_threads)\n"
    )
    pytester.makepyfile(test_leaky=LEAKY_SUITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=4, errors=3)
    result.stdout.fnmatch_lines(["*non-daemon thread(s) running: inner-leaker*"])
    result.stdout.fnmatch_lines(["*leaked environment variable(s)*DS_TEST_INNER_LEAK*"])
    result.stdout.fnmatch_lines(["*replaced sys.excepthook*"])
