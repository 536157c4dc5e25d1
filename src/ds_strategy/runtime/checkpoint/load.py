"""``load_checkpoint``: validate and build everything first, agree across ranks, then mutate the engine.

Loading works at any world size and stage (see [Note: resharding]): each rank fills its masters' flat
ranges of its *own* layout from the saved partitions. Nothing of the engine changes until every rank
has read and checked every value it needs; a bad checkpoint raises the same error on all ranks and
leaves every engine as it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_strategy.log import get_logger

from ..layout import FlatLayout
from . import rng
from .experts import ExpertSource, expert_group_indices, expert_module_entries
from .format import MODEL, CheckpointError, expect_format, ranks, read
from .frozen import FrozenSource, check_frozen, read_partitions, write_partitions
from .partition import Source, scalar_value
from .save import module_entries
from .store import rank_reader, read_meta, resolve
from .sync import agree
from .target import CheckpointTarget

log = get_logger("ds_strategy.runtime.checkpoint")


# Param-group keys that choose how an optimizer runs, not what it computes: the running optimizer keeps its own.
_IMPLEMENTATION = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})


def refuse_custom_load_fn(custom_load_fn: Any) -> None:
    """DeepSpeed's ``load_checkpoint(custom_load_fn=...)``: accepted only as None (both engines)."""
    if custom_load_fn is not None:
        raise NotImplementedError(
            "load_checkpoint(custom_load_fn=...): DeepSpeed's hook for loading a module state itself is not "
            "supported; load the weights with engine.load_full_state_dict(sd) after load_checkpoint"
        )


def copy_hyperparameters(group: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """Into a running optimizer's param ``group``, a saved group's values of what it computes (lr, betas,
    weight decay, a scheduler's ``initial_lr`` ...): the keys the group has, not how it runs."""
    group.update({k: v for k, v in saved.items() if k in group and k not in _IMPLEMENTATION})


@dataclass
class _Plan:
    tag_dir: Path
    meta: dict[str, Any]
    masters: list[list[torch.Tensor]]  # per group, per bucket
    entries: dict[str, torch.Tensor]  # this engine's module entries, as they will be copied in
    frozen: list[list[tuple[int, int, torch.Tensor]]]  # stage 3's frozen partitions (frozen.read_partitions)
    optimizer_state: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def check_model(
    engine: CheckpointTarget, meta: dict[str, Any], layouts: list[FlatLayout], where: str, frozen: FrozenSource
) -> None:
    """The checkpoint holds exactly this model's parameters and buffers, with the same shapes (frozen
    parameters in either form: [Note: frozen parameters in checkpoints])."""
    problems: list[str] = []
    saved = {slot.name: slot.shape for layout in layouts for slot in layout.params}
    experts = set(expert_group_indices(engine))  # checked against their own files ([Note: expert files])
    ours = {
        slot.name: slot.shape
        for g, gs in enumerate(engine.stage.groups)
        if g not in experts
        for slot in gs.layout.params
    }
    for name, shape in ours.items():
        if name not in saved:
            problems.append(f"trainable parameter {name!r} {list(shape)} is not in the checkpoint")
        elif tuple(saved[name]) != tuple(shape):
            problems.append(f"{name!r} has shape {list(saved[name])} in the checkpoint, {list(shape)} in the model")
    problems += [
        f"checkpoint has trainable parameter {n!r}, the model has none by that name" for n in saved if n not in ours
    ]
    rest, _, _ = module_entries(engine)
    saved_rest = meta["module_entries"]
    expert_entries = expert_module_entries(engine.module)  # checked against their own files
    for name, value in rest.items():
        if name in expert_entries:
            continue
        entry = saved_rest.get(name)
        if entry is None and (name in frozen.excluded or frozen.shape(name) is not None):
            saved_shape = frozen.shape(name)
            if saved_shape is not None and saved_shape != tuple(value.shape):
                problems.append(f"{name!r} has shape {list(saved_shape)} in the checkpoint, {list(value.shape)} here")
            continue
        if entry is None:
            kind = "trainable in the checkpoint, frozen here" if name in saved else "not in the checkpoint"
            problems.append(f"module entry {name!r} {list(value.shape)} is {kind}")
        elif list(entry["shape"]) != list(value.shape):
            problems.append(f"{name!r} has shape {entry['shape']} in the checkpoint, {list(value.shape)} in the model")
    stored_frozen = {slot.name for gs in getattr(engine.stage, "frozen", ()) for slot in gs.layout.params}
    problems += [
        f"checkpoint has module entry {n!r}, the model has none by that name"
        for n in saved_rest
        if n not in rest and n not in ours and n not in stored_frozen
    ]
    problems += check_frozen(engine, frozen, where)
    problems += [
        f"checkpoint has frozen parameter {n!r}, the model has none by that name"
        for n in frozen.names()
        if n not in rest and n not in stored_frozen
    ]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise CheckpointError(f"{where} was saved from another model: " + "; ".join(problems[:10]) + more)


def _plan(
    engine: CheckpointTarget, load_dir: str | os.PathLike[str], tag: Any, *, optimizer: bool, module_only: bool
) -> _Plan:
    tag_dir = resolve(load_dir, None if tag is None else str(tag))
    meta = read_meta(tag_dir)
    layouts = [FlatLayout.from_dict(g["layout"]) for g in meta["groups"]]
    model_path = tag_dir / MODEL
    model = expect_format(read(model_path, expected_size=meta["files"].get(MODEL), mmap=True), model_path)
    saved_entries = {k: model["module"][k] for k in meta["module_entries"]}
    reader = rank_reader(tag_dir, meta, layouts)
    frozen = FrozenSource(meta, reader, saved_entries)
    check_model(engine, meta, layouts, str(tag_dir), frozen)
    expert_source = ExpertSource(tag_dir, meta, engine.module)
    entries = {
        name: saved_entries[name] if name in saved_entries else frozen.full(name)
        for name in module_entries(engine)[0]
        if name not in expert_source.entries and frozen.has(name)  # else: an excluded frozen parameter keeps its value
    }
    entries.update(_expert_entries(engine, expert_source, frozen.excluded))
    source = Source(layouts, reader)
    experts = set(expert_group_indices(engine))
    plan = _Plan(
        tag_dir,
        meta,
        [
            (expert_source if g in experts else source).fill(gs, "fp32", torch.float32)
            for g, gs in enumerate(engine.stage.groups)
        ],
        entries,
        read_partitions(engine, frozen),
    )
    opt = engine.optimizer
    if optimizer and not module_only and opt is not None:
        if meta.get("optimizer_states_excluded", False):
            raise CheckpointError(
                f"{tag_dir} holds the weights only (saved with save_weights_only=True / "
                "exclude_optimizer_states=True): no optimizer state to resume from; pass "
                "load_optimizer_states=False to load the weights (in Lightning: trainer.validate/test/predict("
                "ckpt_path=...) load them)"
            )
        saved_experts = meta.get("expert_groups", [])
        if len(meta["groups"]) + len(saved_experts) != len(opt.param_groups) or len(saved_experts) != len(experts):
            raise CheckpointError(
                f"{tag_dir} has {len(meta['groups'])} dense and {len(saved_experts)} expert optimizer param groups, "
                f"this optimizer has {len(opt.param_groups) - len(experts)} and {len(experts)}; pass "
                "load_optimizer_states=False to load the weights only"
            )
        state: dict[int, dict[str, Any]] = {}
        index = 0
        whole = engine.stage.whole
        for g, gs in enumerate(engine.stage.groups):
            if whole is not None and g in whole.groups:  # one entry per whole tensor this rank steps, by name
                for name in whole.names[g]:
                    entry = source.tensor_state(name, str(tag_dir))
                    if entry:
                        state[index] = entry
                    index += 1
                continue
            if g not in experts and any(
                source.per_tensor(saved) for saved in {source.where[slot.name].group for slot in gs.layout.params}
            ):
                raise CheckpointError(
                    f"{tag_dir} holds a per-tensor optimizer's state (Muon, Adafactor ...), this optimizer is "
                    "element-wise; pass load_optimizer_states=False to load the weights only"
                )
            if g in experts:
                scalars, keys = expert_source.scalars(gs)
                flats = {key: expert_source.fill(gs, ("state", key), torch.float32) for key in keys}
            else:
                origin, scalars, keys = source.scalars_for(gs.layout, g)
                flats = {}
                for key in keys:
                    assert origin is not None
                    flats[key] = source.fill(gs, ("state", key), source.state_dtype(origin, key))
            # one optimizer state entry per bucket (flat master) of the group, in bucket order
            for b in range(len(gs.masters)):
                if keys or scalars:
                    entry = {k: v[b] for k, v in flats.items()}
                    entry.update({k: scalar_value(v) for k, v in scalars.items()})
                    state[index] = entry
                index += 1
        sd = opt.state_dict()
        dense_saved = iter(meta["groups"])
        expert_saved = iter(saved_experts)
        in_order = [next(expert_saved) if g in experts else next(dense_saved) for g in range(len(sd["param_groups"]))]
        for group, saved in zip(sd["param_groups"], in_order, strict=True):
            copy_hyperparameters(group, saved["hyperparams"] or {})
        sd["state"] = state
        plan.optimizer_state = sd
    if not module_only:
        rank = engine.coll.rank
        if rank < meta["world_size"]:
            plan.rng = source.rank_data(rank)["rng"]
        else:
            plan.notes.append(
                f"rank {rank} has no saved RNG state (saved by {ranks(meta['world_size'])}); kept its own"
            )
    return plan


def _expert_entries(engine: CheckpointTarget, source: ExpertSource, excluded: set[str]) -> dict[str, torch.Tensor]:
    """This rank's experts' frozen parameters and buffers from their expert files ([Note: expert files])."""
    out: dict[str, torch.Tensor] = {}
    rest, _, _ = module_entries(engine)
    for name, value in rest.items():
        if name not in source.entries:
            continue
        saved = source.module_entry(name)
        if saved is None:
            if name in excluded:  # a frozen parameter the checkpoint left out keeps its value
                continue
            where = source.entries[name]
            raise CheckpointError(
                f"{source.tag_dir}: the file of expert {where.expert} of MoE layer {where.layer} lacks "
                f"{where.suffix!r} ({name!r} on rank {engine.coll.rank}); it was saved before expert buffers and "
                "frozen expert parameters went into the expert files, or from another model"
            )
        if tuple(saved.shape) != tuple(value.shape):
            raise CheckpointError(
                f"{source.tag_dir}: {name!r} (expert {source.entries[name].expert}) has shape {list(saved.shape)} in "
                f"its expert file, {list(value.shape)} in the model"
            )
        out[name] = saved
    return out


@torch.no_grad()
def _apply(engine: CheckpointTarget, plan: _Plan, *, optimizer: bool, scheduler: bool, module_only: bool) -> None:
    stage = engine.stage
    for gs, pieces in zip(stage.groups, plan.masters, strict=True):
        for master, piece in zip(gs.masters, pieces, strict=True):
            master.data.copy_(piece)
    stage.publish()
    stage.zero_grad()
    rest, _, _ = module_entries(engine)
    for name, target in rest.items():
        if name in plan.entries:
            target.copy_(plan.entries[name])
    write_partitions(engine, plan.frozen)
    if module_only:
        return
    meta = plan.meta
    if plan.optimizer_state is not None and engine.optimizer is not None:
        engine.optimizer.load_state_dict(plan.optimizer_state)
    restore_progress(engine, meta, scheduler=scheduler)
    if plan.rng is not None:
        rng.restore(plan.rng)


def restore_progress(engine: CheckpointTarget, meta: dict[str, Any], *, scheduler: bool) -> None:
    """The step counters, loss scale and (with ``scheduler``) the lr scheduler from a checkpoint's metadata:
    the engine's training progress, the same in the plain and the pipeline checkpoint."""
    if scheduler and engine.lr_scheduler is not None and meta.get("scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    engine.counters.load_state_dict(meta["counters"])


def load_checkpoint(
    engine: CheckpointTarget,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    *,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Load ``load_dir/<tag>`` (default: the tag named by ``latest``); return (tag directory, client state)."""
    plan = agree(
        engine.coll,
        lambda: _plan(engine, load_dir, tag, optimizer=load_optimizer_states, module_only=load_module_only),
        "load_checkpoint",
    )
    _apply(
        engine, plan, optimizer=load_optimizer_states, scheduler=load_lr_scheduler_states, module_only=load_module_only
    )
    meta = plan.meta
    if engine.coll.rank == 0:
        log.info(
            "loaded checkpoint %s (saved by %s at stage %d; now %s at stage %d)%s",
            plan.tag_dir,
            ranks(meta["world_size"]),
            meta["stage"],
            ranks(engine.coll.world_size),
            stage_of(engine),
            "".join(f"; {n}" for n in plan.notes),
        )
    return str(plan.tag_dir), meta.get("client_state") or {}


def stage_of(engine: CheckpointTarget) -> int:
    return int(engine.stage.stage)
