"""Immutable, hashable stand-ins for JSON containers.

Config objects are frozen dataclasses; a plain ``dict`` inside one (optimizer params, the ignored
sections kept for round-tripping) would make it mutable and unhashable. ``freeze`` turns JSON-like
data into ``FrozenDict`` / ``tuple`` all the way down; ``thaw`` turns it back into ``dict`` / ``list``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class FrozenDict(Mapping[str, Any]):
    """A read-only mapping with a stable hash (contents must be frozen too, see ``freeze``)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data: dict[str, Any] = dict(data or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"


def freeze(value: Any) -> Any:
    """Deep-convert mappings to ``FrozenDict`` and lists/tuples to tuples; scalars pass through."""
    if isinstance(value, Mapping):
        return FrozenDict({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of ``freeze``: JSON-serialisable ``dict`` / ``list`` structures."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
