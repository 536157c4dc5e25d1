"""Pipeline checkpoints: each rank writes its own shards, so saving moves no tensor between ranks, and a
checkpoint loads at any pipeline depth and data-parallel degree.

    SAVE_DIR/latest                          the newest complete tag (rewritten atomically, after the tag)
    SAVE_DIR/<tag>/pipe_rank_00003_states.pt rank 3: per entry it saves, its pieces; its RNG state
    SAVE_DIR/<tag>/pipe_meta.pt              rank 0, written last: layers, stages, data-parallel degree, which
                                             ranks hold each entry, counters, scheduler, loss scaler,
                                             per-tensor optimizer state, client state, every file's size

An *entry* is a layer with state (``layer_03``) or a tied module (``tied_embed``, saved by the first stage
holding it). Per trainable parameter, each data-parallel rank of the owning stage saves the piece of the
flattened fp32 master and of every per-element optimizer state (``exp_avg`` ...) in its ZeRO shard
(``start``: offset in the flattened parameter; at ZeRO stage 0 the same shard boundaries, so no piece is
written twice), keyed by the layer's own parameter names. Frozen parameters and buffers are saved whole,
by the stage's data-parallel rank 0. Loading: each rank copies, for the parameters it holds now, the
range its own shard needs out of the pieces (``PipeCheckpoint.read_range``; memory-mapped files, so only
those pages are read), whatever the depth, data-parallel degree or ZeRO stage that wrote them.
``pipe_state_dict`` (and ``ds-zero-to-fp32``) joins the pieces into one state dict with the names of a
one-stage ``PipelineModule``: ``"<layer>.<name>"`` and ``"tied_modules.<key>.<name>"``.

Publishing is the main format's ([Note: publishing a tag] and [Note: atomic writes] in
runtime/checkpoint/): the ranks write into ``SAVE_DIR/.<tag>.partial``; rank 0 writes ``pipe_meta.pt``
last, renames the directory to ``<tag>`` and only then rewrites ``latest``, so a process killed at any
point leaves the previous tag loadable. Every file holds plain values only and is read with
``torch.load(weights_only=True)`` ([Note: safe files]). A step that fails on one rank fails on every rank
(``checkpoint.sync.agree``, over the engine's gloo control group), and loading reads and checks every
value before it changes the engine.

Format 1 (one file of whole values per layer, written before shards) is still read.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from ds_strategy.log import get_logger

from ..checkpoint import rng
from ..checkpoint.format import CheckpointError, atomic_save, check_safe
from ..checkpoint.load import copy_hyperparameters, restore_progress
from ..checkpoint.pipe_files import (
    FORMAT,
    PIPE_META,
    VERSION,
    PipeCheckpoint,
    layer_key,
    rank_file,
    resolve_pipe,
    tied_key,
)
from ..checkpoint.save import _agreed_tag, group_hyperparameters
from ..checkpoint.store import check_tag, write_tag
from ..checkpoint.sync import agree, gather
from ..zero.access import find
from ..zero.buffers import GroupStorage

log = get_logger("ds_strategy.runtime.pipe")

# The engine is typed structurally (Any): importing PipelineEngine here would close an import cycle.
PipelineEngine = Any


@dataclass(frozen=True)
class _World:
    """What ``checkpoint.sync`` needs of a communicator: the whole pipeline grid, over the gloo control group."""

    world_size: int
    group: Any


@dataclass(frozen=True)
class _Rank:
    rank: int


@dataclass(frozen=True)
class _TagPolicy:
    """What ``save._agreed_tag`` reads of an engine: the tag policy and the rank (over the whole grid)."""

    tag_validation: str
    coll: _Rank


def _world(engine: PipelineEngine) -> Any:
    return cast(Any, _World(dist.get_world_size(), engine.control))


def _owned(engine: PipelineEngine) -> list[tuple[str, str, torch.nn.Module]]:
    """(entry, name prefix, module) of every layer with a module and every tied module this stage holds."""
    module = engine.module
    out = []
    for idx in module.local_layers:
        sub = module._modules.get(str(idx))
        if sub is not None:
            out.append((layer_key(idx), f"{idx}.", sub))
    for key, sub in module.tied_modules.items():
        out.append((tied_key(key), f"tied_modules.{key}.", sub))
    return out


def _saves(engine: PipelineEngine, key: str) -> bool:
    """Whether this stage saves ``key``: a tied module is saved by the first stage holding it."""
    for tie, stages in engine.module.tied_stages().items():
        if key == tied_key(tie):
            return bool(engine.stage_id == min(stages))
    return True


def _has_state(sub: torch.nn.Module) -> bool:
    return any(True for _ in sub.parameters()) or any(True for _ in sub.buffers())


def _fragment(gs: GroupStorage, index: int) -> tuple[int, int]:
    """(start in the flattened parameter, numel) of the part of parameter ``index`` this rank's masters hold
    (``safe_get_local_fp32_param``'s fragment: the whole parameter at stage 0, its shard at stage 1)."""
    slot = gs.layout.params[index]
    lo, hi = gs.master_range(slot.bucket)
    a, z = max(lo, slot.offset), min(hi, slot.end)
    return (a - slot.offset, z - a) if a < z else (0, 0)


def _shard(gs: GroupStorage, index: int) -> tuple[int, int]:
    """(start in the flattened parameter, numel) of the part of parameter ``index`` in this rank's ZeRO
    shard: what it saves (stage 0 keeps every bucket whole, but saves the same pieces as stage 1)."""
    slot = gs.layout.params[index]
    s_lo, s_hi = gs.layout.shard_range(slot.bucket, gs.rank)
    a, z = max(s_lo, slot.offset), min(s_hi, slot.end)
    return (a - slot.offset, z - a) if a < z else (0, 0)


def _state_keys(engine: PipelineEngine) -> list[str]:
    opt = engine.engine.optimizer
    if opt is None:
        return []
    for group in opt.param_groups:
        for master in group["params"]:
            state = opt.state.get(master, {})
            return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape)
    return []


def _scalar_state(engine: PipelineEngine) -> dict[str, Any]:
    opt = engine.engine.optimizer
    if opt is None:
        return {}
    for group in opt.param_groups:
        for master in group["params"]:
            state = opt.state.get(master, {})
            return {
                k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                for k, v in state.items()
                if not (isinstance(v, torch.Tensor) and v.shape == master.shape)
            }
    return {}


def _piece(access: Any, g: int, i: int, at: int, n: int, kind: str, key: str | None = None) -> torch.Tensor:
    """``n`` elements from ``at`` of this rank's fragment of ``kind``, as a host copy of its own."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    return access.get_local(g, i, kind, key)[at : at + n].to("cpu", copy=True)


def _entry(engine: PipelineEngine, prefix: str, sub: torch.nn.Module, keys: list[str], whole: bool) -> dict[str, Any]:
    """This rank's part of one entry: the pieces of its trainable parameters in its shard, and (``whole``:
    the stage's data-parallel rank 0) its frozen parameters and buffers. Local reads only."""
    params: dict[str, Any] = {}
    module: dict[str, torch.Tensor] = {}
    for name, p in sub.named_parameters():
        found = find(p)
        if found is None:  # frozen (or not trained by the engine): as the module holds it
            if whole:
                module[name] = p.detach().to("cpu", torch.float32, copy=True)
            continue
        access, g, i = found
        gs = access.stage.groups[g]
        start, n = _shard(gs, i)
        f_start, _ = _fragment(gs, i)
        at = start - f_start  # where the shard's piece sits in the rank's fragment

        params[name] = {
            "shape": list(p.shape),
            "start": start,
            "fp32": _piece(access, g, i, at, n, "fp32_param"),
            "state": {k: _piece(access, g, i, at, n, "optimizer_state", k) for k in keys},
        }
    if whole:
        for name, b in sub.named_buffers():
            module[name] = b.detach().to("cpu", copy=True)
    return {"prefix": prefix, "params": params, "module": module}


def save_pipe_checkpoint(
    engine: PipelineEngine,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    *,
    save_latest: bool = True,
) -> Path:
    """Every rank calls it; each writes its own file (no tensor crosses ranks). See the module docstring."""
    inner = engine.engine
    world = _world(engine)
    rank = engine.global_rank
    root = Path(save_dir)
    module = engine.module
    dp_ranks = module.groups.data_ranks

    save_id = gather(world, uuid.uuid4().hex)[0]  # rank 0's: ties every file to this save

    def prepare() -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        name = check_tag(str(tag) if tag is not None else f"global_step{inner.global_steps}")
        keys = _state_keys(engine)
        whole = dp_ranks[0] == rank
        entries = {
            key: _entry(engine, prefix, sub, keys, whole)
            for key, prefix, sub in _owned(engine)
            if _saves(engine, key) and _has_state(sub)
        }
        ours = {
            "format": FORMAT,
            "version": VERSION,
            "tag": name,
            "save_id": save_id,
            "rank": rank,
            "stage": engine.stage_id,
            "data_parallel_rank": dp_ranks.index(rank),
            "entries": entries,
            "rng": rng.capture(),
        }
        check_safe(ours, rank_file(rank))
        if rank != 0:
            return name, ours, None
        state = {} if client_state is None else client_state
        check_safe(state, "client_state")
        from ds_strategy._version import __version__

        meta = {
            "format": FORMAT,
            "version": VERSION,
            "tag": name,
            "save_id": save_id,
            "num_layers": module._num_layers,
            "num_stages": module.num_stages,
            "data_parallel": len(dp_ranks),
            "world_size": world.world_size,
            "parts": list(module.parts),
            "tied": {k: list(v) for k, v in module.tied_stages().items()},
            "entries": {},
            "counters": inner.counters.state_dict(),
            "scheduler": inner.lr_scheduler.state_dict() if inner.lr_scheduler is not None else None,
            "loss_scaler": inner.loss_scaler.state_dict(),
            "optimizer_scalars": _scalar_state(engine),
            # lr, betas, weight decay ...: a scheduler writes the lr only at its next step (as the main format)
            "hyperparams": group_hyperparameters(inner.optimizer) if inner.optimizer is not None else [],
            "micro_offset": int(module.micro_offset),
            "client_state": state,
            "torch_version": str(torch.__version__),
            "ds_strategy_version": __version__,
            "files": {},
        }
        check_safe(meta, f"{PIPE_META} (scheduler, loss scaler or optimizer state)")
        return name, ours, meta

    name, ours, meta = agree(world, prepare, "save_checkpoint (preparing)")
    # checkpoint.tag_validation as in the main format: "Fail" raises on every rank, else rank 0's tag
    name = _agreed_tag(cast(Any, _TagPolicy(inner.tag_validation, _Rank(rank))), gather(world, name))
    ours["tag"] = name
    if meta is not None:
        meta["tag"] = name
    written = gather(world, {key: {"prefix": e["prefix"]} for key, e in ours["entries"].items()})
    if meta is not None:  # rank 0: which ranks hold each entry
        for r, entries in enumerate(written):
            for key, entry in entries.items():
                meta["entries"].setdefault(key, {"prefix": entry["prefix"], "ranks": []})["ranks"].append(r)

    def write(staging: Path) -> dict[str, int]:
        return {rank_file(rank): atomic_save(ours, staging / rank_file(rank))}

    final = write_tag(
        world, root, name, write, meta, PIPE_META, rank=rank, local_rank=inner.local_rank, save_latest=save_latest
    )
    if rank == 0:
        log.info("saved pipeline checkpoint %s (%d stages x %d data-parallel)", final, module.num_stages, len(dp_ranks))
    return final


# ---------------------------------------------------------------------------------------------------- load
@dataclass
class _Plan:
    tag_dir: Path
    meta: dict[str, Any]
    # (access, group, index, fp32 fragment, {state key: fragment}) per trainable parameter of this rank
    trainable: list[tuple[Any, int, int, torch.Tensor, dict[str, torch.Tensor]]] = field(default_factory=list)
    module: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (target, value)
    rng: dict[str, Any] | None = None


def _plan(engine: PipelineEngine, load_dir: str | os.PathLike[str], tag: Any, with_optimizer: bool) -> _Plan:
    tag_dir = resolve_pipe(load_dir, None if tag is None else str(tag))
    source = PipeCheckpoint(tag_dir)
    meta = source.meta
    module = engine.module
    if meta["num_layers"] != module._num_layers:
        raise CheckpointError(
            f"{tag_dir} holds {meta['num_layers']} layers but this PipelineModule has {module._num_layers}"
        )
    plan = _Plan(tag_dir, meta)
    for key, _, sub in _owned(engine):
        if not _has_state(sub):
            continue
        if not source.has(key):
            raise CheckpointError(
                f"{tag_dir} has no entry {key!r} (it holds {source.entries()}): saved from another model?"
            )
        saved = source.params(key)
        whole = source.module_entries(key)
        for name, p in sub.named_parameters():
            shape = saved.get(name, list(whole[name].shape) if name in whole else None)
            if shape is None:
                raise CheckpointError(
                    f"{tag_dir} entry {key!r} has no parameter {name!r} (it holds {sorted([*saved, *whole])})"
                )
            if list(shape) != list(p.shape):
                raise CheckpointError(
                    f"{tag_dir} entry {key!r}: {name!r} has shape {list(shape)} in the checkpoint, {list(p.shape)} here"
                )
            found = find(p)
            if found is None:  # frozen here: its whole value
                value = whole[name] if name in whole else source.full(key, name)
                plan.module.append((p, value))
                continue
            access, g, i = found
            start, n = _fragment(access.stage.groups[g], i)
            if name in whole:  # frozen when saved, trained now
                fp32 = whole[name].reshape(-1)[start : start + n].float()
                plan.trainable.append((access, g, i, fp32, {}))
                continue
            fp32 = source.read_range(key, name, "fp32", start, torch.empty(n, dtype=torch.float32))
            states = {}
            if with_optimizer:
                states = {
                    k: source.read_range(key, name, k, start, torch.empty(n, dtype=torch.float32))
                    for k in source.state_keys(key, name)
                }
            plan.trainable.append((access, g, i, fp32, states))
        for name, b in sub.named_buffers():
            if name in whole:
                if list(whole[name].shape) != list(b.shape):
                    raise CheckpointError(
                        f"{tag_dir} entry {key!r}: buffer {name!r} has shape {list(whole[name].shape)} in the "
                        f"checkpoint, {list(b.shape)} here"
                    )
                plan.module.append((b, whole[name]))
    same_grid = (
        not source.format1
        and meta["num_stages"] == module.num_stages
        and meta["data_parallel"] == len(module.groups.data_ranks)
    )
    if same_grid:  # each rank's RNG state where it was (another grid: each rank keeps its own)
        plan.rng = source.rank_data(engine.global_rank)["rng"]
    return plan


def load_pipe_checkpoint(
    engine: PipelineEngine,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Read and check everything first (agreed across ranks), then change the engine."""
    inner = engine.engine
    with_optimizer = load_optimizer_states and not load_module_only and inner.optimizer is not None
    plan = agree(_world(engine), lambda: _plan(engine, load_dir, tag, with_optimizer), "load_checkpoint")
    meta = plan.meta
    ensured: set[str] = set()  # optimizer state keys created on every master (once per load, not per parameter)
    with torch.no_grad():
        for access, g, i, fp32, states in plan.trainable:
            access.set_local(g, i, fp32, "fp32_param")
            for key, value in states.items():
                if key not in ensured:
                    _ensure_state(engine, key)
                    ensured.add(key)
                access.set_local(g, i, value, "optimizer_state", key)
        for target, value in plan.module:
            target.copy_(value)
    if with_optimizer:
        _ensure_scalars(engine, meta["optimizer_scalars"])
        saved_groups = meta.get("hyperparams") or []
        if len(saved_groups) == len(inner.optimizer.param_groups):  # every stage's groups: the same client spec
            for group, saved in zip(inner.optimizer.param_groups, saved_groups, strict=True):
                copy_hyperparameters(group, saved)
    if not load_module_only:
        restore_progress(inner, meta, scheduler=load_lr_scheduler_states)
        engine.module.micro_offset = int(meta.get("micro_offset", engine.module.micro_offset))
        if plan.rng is not None:
            rng.restore(plan.rng)
    inner.stage.publish()
    dist.barrier(group=engine.control)
    return str(plan.tag_dir), dict(meta["client_state"])


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
                if isinstance(v, torch.Tensor):  # where the optimizer keeps it (a fused one: the device)
                    old = opt.state[master].get(k)
                    opt.state[master][k] = v.to(old.device if isinstance(old, torch.Tensor) else v.device, copy=True)
                else:
                    opt.state[master][k] = v
