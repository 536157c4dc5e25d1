"""The package logger: progress lines (``steps_per_print``) and step-skip notices are shown by default.

Like DeepSpeed's and Lightning's loggers, ``ds_strategy`` gets its own stderr handler at INFO unless the
application configured logging itself (a handler on the root logger or on ``ds_strategy``), so a plain
script sees the engine's progress lines without any setup, and an application that routes logging
elsewhere keeps full control. ``DS_STRATEGY_LOG_LEVEL`` (DEBUG, INFO, WARNING, ...) changes the level.
"""

from __future__ import annotations

import logging
import sys

from ds_strategy import env

ROOT = "ds_strategy"
LEVEL_ENV = env.LOG_LEVEL


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` under the package logger, which is configured on first use."""
    _configure_root()
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def _configure_root() -> None:
    root = logging.getLogger(ROOT)
    if getattr(root, "_ds_configured", False):
        return
    root._ds_configured = True  # type: ignore[attr-defined]
    level = (env.get(LEVEL_ENV) or "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{LEVEL_ENV}={level!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR")
    if root.level == logging.NOTSET:
        root.setLevel(level)
    if root.handlers or logging.getLogger().handlers:
        return  # the application configured logging: leave formatting and routing to it
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[ds_strategy %(levelname)s] %(message)s"))
    root.addHandler(handler)
