"""The package logger shows progress lines by default and leaves a configured application alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
{setup}
from ds_strategy.log import get_logger
get_logger("ds_strategy.runtime").info("progress line")
get_logger("ds_strategy.runtime").debug("debug line")
"""


def _stderr(setup: str, env_level: str | None = None) -> str:
    env = dict(os.environ)
    env.pop("DS_STRATEGY_LOG_LEVEL", None)
    if env_level:
        env["DS_STRATEGY_LOG_LEVEL"] = env_level
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(setup=setup)], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0 or env_level == "LOUD", out.stderr
    return out.stderr


def test_info_lines_shown_without_any_setup() -> None:
    err = _stderr("")
    assert "[ds_strategy INFO] progress line" in err
    assert "debug line" not in err


def test_level_from_environment() -> None:
    assert "debug line" in _stderr("", env_level="DEBUG")
    assert "progress line" not in _stderr("", env_level="WARNING")


def test_configured_application_keeps_its_own_format() -> None:
    err = _stderr("logging.basicConfig(level=logging.INFO, format='APP %(message)s', stream=sys.stderr)")
    assert "APP progress line" in err
    assert "[ds_strategy" not in err


def test_bad_level_is_named() -> None:
    err = _stderr("", env_level="LOUD")
    assert "DS_STRATEGY_LOG_LEVEL='LOUD' is not a logging level" in err


@pytest.mark.parametrize("name", ["ds_strategy.runtime", "runtime"])
def test_names_live_under_the_package_logger(name: str) -> None:
    from ds_strategy.log import get_logger

    assert get_logger(name).name == "ds_strategy.runtime"
