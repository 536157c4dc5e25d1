"""Pipeline checkpoints: one file per layer, so a checkpoint loads at any pipeline depth.

    SAVE_DIR/latest                              the newest tag
    SAVE_DIR/<tag>/layer_03-model_states.pt      layer 3: {"module": fp32 values, "optimizer": per-element state}
    SAVE_DIR/<tag>/tied_<key>-model_states.pt    a tied module, written once (by the first stage holding it)
    SAVE_DIR/<tag>/pipe_meta.pt                  layers, stages, counters, scheduler, loss scaler, scalar state

Values are whole (every data-parallel rank's ZeRO-1 slices gathered, fp32 masters, not the 16-bit copies),
keyed by the layer's own parameter names, so loading is: each stage reads the files of the layers it owns
now, whatever the depth, data-parallel degree or ZeRO stage that wrote them. ``pipe_state_dict`` (and
``ds-zero-to-fp32``) merges the layer files into one state dict with the names of a one-stage
``PipelineModule``: ``"<layer>.<name>"`` and ``"tied_modules.<key>.<name>"``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.format import LATEST, CheckpointError
from ..checkpoint.load import restore_progress
from ..zero.access import find
from .files import FORMAT, PIPE_META, layer_file, resolve_pipe, tied_file

# The engine is typed structurally (Any): importing PipelineEngine here would close an import cycle.
PipelineEngine = Any


def _owned(engine: PipelineEngine) -> list[tuple[str, str, torch.nn.Module]]:
    """(file, name prefix, module) of everything this stage saves: its layers and its first-owned ties."""
    module = engine.module
    out = []
    for idx in module.local_layers:
        sub = module._modules.get(str(idx))
        if sub is not None:
            out.append((layer_file(idx), f"{idx}.", sub))
    for key, sub in module.tied_modules.items():  # written by the first stage holding it (_first_tie_stage)
        out.append((tied_file(key), f"tied_modules.{key}.", sub))
    return out


def _first_tie_stage(engine: PipelineEngine, fname: str) -> bool:
    for key, stages in engine.module.tied_stages().items():
        if fname == tied_file(key):
            return engine.stage_id == min(stages)
    return True


def _scalar_state(engine: PipelineEngine) -> dict[str, Any]:
    opt = engine.engine.optimizer
    if opt is None:
        return {}
    for group in opt.param_groups:
        for master in group["params"]:
            state = opt.state.get(master, {})
            return {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.shape == master.shape)}
    return {}


def _state_keys(engine: PipelineEngine) -> list[str]:
    opt = engine.engine.optimizer
    if opt is None:
        return []
    for group in opt.param_groups:
        for master in group["params"]:
            state = opt.state.get(master, {})
            return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape)
    return []


def save_pipe_checkpoint(
    engine: PipelineEngine,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
) -> Path:
    """Every rank calls it (the full values are gathered across each data-parallel group)."""
    inner = engine.engine
    name = str(tag) if tag is not None else f"global_step{inner.global_steps}"
    if not name or "/" in name or name.startswith(".") or name == LATEST:
        raise CheckpointError(f"checkpoint tag {name!r} cannot name a directory; use a name without '/' or leading '.'")
    tag_dir = Path(save_dir) / name
    writer = engine.module.groups.data_ranks[0] == engine.global_rank
    if writer:
        tag_dir.mkdir(parents=True, exist_ok=True)
    keys = _state_keys(engine)
    for fname, prefix, sub in _owned(engine):
        values: dict[str, torch.Tensor] = {}
        states: dict[str, dict[str, torch.Tensor]] = {}
        for pname, p in sub.named_parameters():
            found = find(p)
            if found is None:  # frozen: as the module holds it
                values[pname] = p.detach().float().cpu().clone()
                continue
            access, g, i = found
            values[pname] = access.get_full(g, i, "fp32_param").cpu().clone()
            states[pname] = {k: access.get_full(g, i, "optimizer_state", k).cpu().clone() for k in keys}
        for bname, b in sub.named_buffers():
            values[bname] = b.detach().cpu().clone()
        if values and writer and _first_tie_stage(engine, fname):  # layers without state get no file
            torch.save({"module": values, "optimizer": states, "prefix": prefix}, tag_dir / fname)
    dist.barrier(group=engine.control)
    if engine.global_rank == 0:
        module = engine.module
        meta = {
            "format": FORMAT,
            "num_layers": module._num_layers,
            "num_stages": module.num_stages,
            "parts": list(module.parts),
            "tied": {k: v for k, v in module.tied_stages().items()},
            "counters": inner.counters.state_dict(),
            "scheduler": inner.lr_scheduler.state_dict() if inner.lr_scheduler is not None else None,
            "loss_scaler": inner.loss_scaler.state_dict(),
            "optimizer_scalars": _scalar_state(engine),
            "client_state": client_state or {},
        }
        torch.save(meta, tag_dir / PIPE_META)
        (Path(save_dir) / LATEST).write_text(name)
    dist.barrier(group=engine.control)
    return tag_dir


def load_pipe_checkpoint(
    engine: PipelineEngine,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str, dict[str, Any]]:
    tag_dir = resolve_pipe(load_dir, None if tag is None else str(tag))
    meta = torch.load(tag_dir / PIPE_META, weights_only=False)
    inner = engine.engine
    if meta["num_layers"] != engine.module._num_layers:
        raise CheckpointError(
            f"{tag_dir} holds {meta['num_layers']} layers but this PipelineModule has {engine.module._num_layers}"
        )
    with_optimizer = load_optimizer_states and not load_module_only and inner.optimizer is not None
    ensured: set[str] = set()  # optimizer state keys created on every master (once per load, not per parameter)
    for fname, _, sub in _owned(engine):
        path = tag_dir / fname
        if not path.is_file():
            continue  # a layer without parameters or buffers
        saved = torch.load(path, weights_only=False)
        for pname, p in sub.named_parameters():
            if pname not in saved["module"]:
                raise CheckpointError(f"{path} has no entry {pname!r} (it holds {sorted(saved['module'])})")
            found = find(p)
            if found is None:
                with torch.no_grad():
                    p.copy_(saved["module"][pname])
                continue
            access, g, i = found
            access.set_full(g, i, saved["module"][pname], "fp32_param")
            if with_optimizer:
                for key, value in saved["optimizer"].get(pname, {}).items():
                    if key not in ensured:
                        _ensure_state(engine, key)
                        ensured.add(key)
                    access.set_full(g, i, value, "optimizer_state", key)
        for bname, b in sub.named_buffers():
            if bname in saved["module"]:
                b.copy_(saved["module"][bname])
    if with_optimizer:
        _ensure_scalars(engine, meta["optimizer_scalars"])
    if not load_module_only:
        restore_progress(inner, meta, scheduler=load_lr_scheduler_states)
    inner.stage.publish()
    dist.barrier(group=engine.control)
    return str(tag_dir), dict(meta["client_state"])


def _ensure_state(engine: PipelineEngine, key: str) -> None:
    """An optimizer that has not stepped yet has no state to write into: create it as its first step would."""
    opt = engine.engine.optimizer
    assert opt is not None
    for group in opt.param_groups:
        for master in group["params"]:
            state = opt.state[master]
            if key not in state:
                state[key] = torch.zeros_like(master)


def _ensure_scalars(engine: PipelineEngine, scalars: dict[str, Any]) -> None:
    opt = engine.engine.optimizer
    assert opt is not None
    for group in opt.param_groups:
        for master in group["params"]:
            for k, v in scalars.items():
                opt.state[master][k] = v.clone() if isinstance(v, torch.Tensor) else v
