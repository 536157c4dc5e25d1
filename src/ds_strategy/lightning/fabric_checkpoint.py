"""``fabric.save`` / ``fabric.load`` under ZeRO: one sharded engine checkpoint per set-up model.

[Note: the Fabric checkpoint layout]
``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 10})`` writes a directory:

    path/
      model/              the engine's checkpoint (every rank its shards, docs/checkpointing.md), with the
                          optimizer state when one of the state's optimizers is this engine's
      fabric_state.pt     rank 0: which optimizer key belongs to which model key, and the rest of the
                          state as plain containers (objects with ``state_dict()``, e.g. an LR scheduler
                          or a model that was not set up, are saved as their state dict)

Several engines (a GAN's generator and discriminator) each get their own directory. Loading goes through
each engine, so a checkpoint saved at one world size or stage loads at another (the engine reshards).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.nn import Module
from torch.optim import Optimizer

from . import checkpoint as lckpt
from .fabric_optimizer import EngineOptimizer

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine

STATE_FILE = "fabric_state.pt"


def _is_engine(obj: Any) -> bool:
    from ds_strategy.runtime import ZeroEngine

    return isinstance(obj, ZeroEngine)


def _owners(state: Mapping[str, Any]) -> tuple[dict[str, ZeroEngine], dict[str, str]]:
    """(model key -> engine, optimizer key -> its model key) of a Fabric state dict."""
    engines = {k: v for k, v in state.items() if _is_engine(v)}
    by_engine = {id(e): k for k, e in engines.items()}
    owner: dict[str, str] = {}
    for key, obj in state.items():
        if isinstance(obj, EngineOptimizer):
            model_key = by_engine.get(id(obj.engine))
            if model_key is None:
                raise ValueError(
                    f"fabric.save/load: state[{key!r}] is the optimizer of a model that is not in the state; the "
                    "ZeRO engine keeps its optimizer state with its weights, so put the model in the state too "
                    "(e.g. {'model': model, 'optimizer': optimizer})"
                )
            owner[key] = model_key
    return engines, owner


def _plain_rest(state: Mapping[str, Any], skip: set[str]) -> dict[str, Any]:
    rest: dict[str, Any] = {}
    for key, obj in state.items():
        if key in skip:
            continue
        rest[key] = obj.state_dict() if isinstance(obj, (Module, Optimizer)) or _stateful(obj) else obj
    return rest


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def save(
    path: str | os.PathLike[str], state: Mapping[str, Any], *, is_global_zero: bool, exclude_frozen_parameters: bool
) -> None:
    """Write ``state`` under ``path`` (a directory; call on every rank)."""
    from ds_strategy.runtime.checkpoint import to_plain

    root = Path(path)
    if root.is_file():
        raise FileExistsError(f"fabric.save({str(path)!r}): a file is in the way; ZeRO checkpoints are directories")
    engines, owner = _owners(state)
    for key, engine in engines.items():
        lckpt.save_engine(
            engine,
            root / key,
            {},
            exclude_frozen_parameters=exclude_frozen_parameters,
            exclude_optimizer_states=engine.optimizer is None or key not in owner.values(),
        )
    if is_global_zero:
        root.mkdir(parents=True, exist_ok=True)
        meta = {"models": sorted(engines), "optimizers": owner, "state": _plain_rest(state, set(engines) | set(owner))}
        torch.save(to_plain(meta), root / STATE_FILE)


def load(path: str | os.PathLike[str], state: Mapping[str, Any] | Module | Optimizer | None, *, strict: bool) -> Any:
    """Load ``path`` into ``state`` in place; return what the checkpoint holds beyond ``state`` (Fabric's
    contract). ``state`` may be a single set-up model (``fabric.load_raw``): a model directory of a
    checkpoint, or a single file with a full state dict (e.g. from DDP or ``ds-zero-to-fp32``)."""
    root = Path(path)
    if _is_engine(state):
        _load_raw(root, cast("ZeroEngine", state), strict)
        return {}
    if isinstance(state, EngineOptimizer) and root.is_file():  # a plain optimizer.state_dict() (DDP's)
        state.engine.load_full_optimizer_state(torch.load(root, map_location="cpu", weights_only=True))
        return {}
    if isinstance(state, (Module, Optimizer)):
        raise TypeError(
            f"fabric.load_raw({str(path)!r}, {type(state).__name__}): under ZeroFabricStrategy load_raw takes a "
            "model set up by fabric.setup, or a set-up optimizer with a single file of a torch optimizer's "
            "state_dict(); load checkpoints of both with fabric.load(path, {'model': ..., 'optimizer': ...})"
        )
    meta_path = root / STATE_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"fabric.load({str(path)!r}): not a ZeroFabricStrategy checkpoint (no {STATE_FILE}); pass the directory "
            "fabric.save wrote, or load a single file of full weights with fabric.load_raw(path, model)"
        )
    meta = torch.load(meta_path, weights_only=True)
    saved: dict[str, Any] = meta["state"]
    if not state:
        return PlainEntries(saved, str(path), [*meta["models"], *meta["optimizers"]])
    engines, owner = _owners(state)
    for key, engine in engines.items():
        if key not in meta["models"]:
            raise KeyError(
                f"fabric.load({str(path)!r}): the checkpoint holds no model {key!r} (it has {meta['models']})"
            )
        with_optimizer = key in owner.values()
        if with_optimizer and key not in meta["optimizers"].values():
            raise KeyError(f"fabric.load({str(path)!r}): the checkpoint holds no optimizer state for model {key!r}")
        lckpt.load_engine(engine, root / key, load_optimizer_states=with_optimizer, load_module_only=not with_optimizer)
    assert isinstance(state, dict)
    for key, obj in list(state.items()):
        if key in engines or key in owner:
            continue
        if key not in saved:
            if strict:
                raise KeyError(f"fabric.load({str(path)!r}): the checkpoint holds no {key!r} (it has {sorted(saved)})")
            continue
        if isinstance(obj, Module):
            obj.load_state_dict(saved[key], strict=strict)
        elif _stateful(obj):
            obj.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    return {k: v for k, v in saved.items() if k not in state}


class PlainEntries(dict[str, Any]):
    """What ``fabric.load(path)`` without a state returns: the checkpoint's plain entries. The sharded models and
    optimizers are not among them (they load into set-up objects); asking for one says how to load it."""

    def __init__(self, entries: Mapping[str, Any], path: str, sharded: list[str]) -> None:
        super().__init__(entries)
        self.path, self.sharded = path, sharded

    def __missing__(self, key: str) -> Any:
        if key in self.sharded:
            raise KeyError(
                f"fabric.load({self.path!r}) without a state returns the plain entries only; {key!r} is sharded "
                f"over the ranks: pass the set-up objects, fabric.load(path, {{{key!r}: ...}}), or write full "
                "weights with ds-zero-to-fp32 <path>/<model key> and torch.load them"
            )
        raise KeyError(key)


def _load_raw(root: Path, engine: ZeroEngine, strict: bool) -> None:
    if root.is_file():
        full = torch.load(root, map_location="cpu", weights_only=True)
        engine.load_full_state_dict(full.get("state_dict", full) if isinstance(full, dict) else full, strict)
        return
    if not lckpt.is_engine_checkpoint(root):
        raise FileNotFoundError(
            f"fabric.load_raw({str(root)!r}, model): neither a file of full weights nor a model directory of a "
            "ZeroFabricStrategy checkpoint (path/<model key>)"
        )
    lckpt.load_engine(engine, root, load_optimizer_states=False, load_module_only=True)
