"""``ZeroStrategy(compile=...)``: the ``compile`` config block written from the strategy's keyword.

The engine compiles the module itself (runtime/compile.py), so the user does not wrap the model in
``torch.compile`` and Lightning's allow-list of strategies for compiled models is not in the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CompileArg = bool | Mapping[str, Any] | None


def apply_compile(raw_config: dict[str, Any], compile: CompileArg, owner: str = "ZeroStrategy") -> dict[str, Any]:
    """``raw_config`` with the ``compile`` block the keyword asks for: True (defaults: inductor), a dict of
    the block's keys (backend, kwargs, ...; enabled unless it says otherwise) or False. A key the config
    states with another value is a ``ValueError`` naming both."""
    if compile is None:
        return raw_config
    if isinstance(compile, bool):
        wanted: dict[str, Any] = {"enabled": compile}
    elif isinstance(compile, Mapping):
        wanted = {"enabled": True, **compile}
    else:
        raise ValueError(
            f"{owner}(compile={compile!r}): use True, False or a dict of the compile block's keys "
            "(backend, kwargs; docs/compile.md)"
        )
    block = dict(raw_config.get("compile") or {})
    for key, value in wanted.items():
        if key in block and block[key] != value:
            raise ValueError(f"{owner}(compile=...) sets compile.{key}={value!r} but the config states {block[key]!r}")
        block[key] = value
    return {**raw_config, "compile": block}
