"""Config problems, the one exception that carries all of them, and the config warning classes.

Every problem names the JSON path (``zero_optimization.stage``), the offending value and what would be
valid. Loading collects problems from every stage (parsing, legacy forms, schema, cross-field checks,
"auto" resolution, batch arithmetic) and raises them together, so a config is fixed in one pass.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# The classes ``ds_strategy.config`` re-exports (``from .errors import *``).
__all__ = [
    "ConfigConflictWarning",
    "ConfigDeprecationWarning",
    "ConfigError",
    "ConfigProblem",
    "ConfigWarning",
    "IgnoredConfigWarning",
]

ROOT_LABEL = "(top level)"


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config: where (dotted JSON path, ``""`` for the root) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or ROOT_LABEL}: {self.message}"


class ConfigError(ValueError):
    """An invalid DeepSpeed config. ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: Iterable[ConfigProblem | str], *, source: str | None = None) -> None:
        self.problems: list[ConfigProblem] = [
            p if isinstance(p, ConfigProblem) else ConfigProblem("", p) for p in problems
        ]
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = f" ({self.source})" if self.source else ""
        if len(self.problems) == 1:
            return f"invalid DeepSpeed config{where}: {self.problems[0]}"
        lines = [f"invalid DeepSpeed config{where}: {len(self.problems)} problems"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Keyword-only ``source`` would be lost by the default exception pickling (multiprocess tests
        # ship exceptions between ranks).
        return (_rebuild_config_error, (self.problems, self.source))


def _rebuild_config_error(problems: list[ConfigProblem], source: str | None) -> ConfigError:
    return ConfigError(problems, source=source)


class ConfigWarning(UserWarning):
    """Base class of the warnings emitted while loading a config."""


class ConfigDeprecationWarning(ConfigWarning, FutureWarning):
    """A tolerated legacy form (``"zero_optimization": true``, ``bfloat16``, ``cpu_offload`` ...).

    A ``FutureWarning`` rather than a ``DeprecationWarning``: the audience is whoever wrote the JSON
    file, and Python hides ``DeprecationWarning`` outside ``__main__``.
    """


class IgnoredConfigWarning(ConfigWarning):
    """A well-known DeepSpeed setting that ds_strategy accepts but does not act on."""


class ConfigConflictWarning(ConfigWarning):
    """The config and the context disagreed and ``on_conflict`` picked a winner."""


def join_path(base: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{base}[{key}]"
    return f"{base}.{key}" if base else key


def path_of(parts: Iterable[str | int]) -> str:
    path = ""
    for part in parts:
        path = join_path(path, part)
    return path


def format_value(value: Any, limit: int = 80) -> str:
    """A value as it would be spelled in the JSON file (``true``, ``null``, ``"auto"``), shortened."""
    try:
        text = json.dumps(value, sort_keys=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def close_matches(word: str, candidates: Sequence[str], n: int = 3) -> list[str]:
    """Candidates that look like ``word`` (case-insensitive; exact case-folded matches first)."""
    folded = {c.lower(): c for c in candidates}
    if word.lower() in folded:
        return [folded[word.lower()]]
    fuzzy = difflib.get_close_matches(word.lower(), list(folded), n=n, cutoff=0.6)
    if not fuzzy:
        return []
    # Only offer runners-up that are nearly as close as the best match: one clear answer reads better.
    best = difflib.SequenceMatcher(None, word.lower(), fuzzy[0]).ratio()
    return [folded[f] for f in fuzzy if difflib.SequenceMatcher(None, word.lower(), f).ratio() >= best - 0.1]


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """``did you mean 'x'?`` (or several near-equal candidates), else the empty string."""
    matches = close_matches(word, candidates)
    if not matches:
        return ""
    if len(matches) == 1:
        return f"did you mean {matches[0]!r}?"
    return "did you mean " + ", ".join(repr(m) for m in matches[:-1]) + f" or {matches[-1]!r}?"
