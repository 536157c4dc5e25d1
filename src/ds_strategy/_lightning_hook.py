"""Register the Lightning strategy names as soon as Lightning is there, without importing it ourselves.

``import ds_strategy`` must make ``Trainer(strategy="zero3")`` work, but importing Lightning (and torch)
costs seconds that a plain-PyTorch user of ``ds_strategy.initialize`` or a config tool should not pay.
So: if ``lightning.pytorch`` is already imported, register now; otherwise a one-shot import hook runs the
registration right after ``lightning.pytorch`` finishes executing, which every route to a ``Trainer``
(``import lightning``, ``import lightning.pytorch as pl``, ``from lightning.pytorch import Trainer``) passes.

Fabric's registry (``lightning.fabric.strategies.STRATEGY_REGISTRY``) is filled by the same registration:
every route to ``Fabric`` (``from lightning.fabric import Fabric``, ``import lightning as L``) runs
``lightning/__init__.py``, which imports ``lightning.pytorch`` right after ``lightning.fabric``, so the
one hook covers both. Hooking ``lightning.fabric`` itself would fire while ``lightning.pytorch`` is not
yet importable (the package ``__init__`` is still running), and the Trainer face needs it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

TARGET = "lightning.pytorch"


def _register() -> None:
    importlib.import_module("ds_strategy.lightning")  # its import registers the names (idempotent)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``lightning.pytorch`` to register after it ran."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; the real finders locate the module
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning())
