"""``save_checkpoint``: every rank writes its partition, rank 0 the rest, and the tag appears only when whole.

Order (see [Note: publishing a tag] and [Note: atomic writes]):
1. every rank builds what it will write and checks it is safe to load (a bad client state fails here, on
   every rank, before any file exists); the ranks agree on the tag;
2. the staging directory is emptied and created; each rank writes ``zero_rank_<r>_optim_states.pt``,
   rank 0 also ``model_states.pt``; the ranks exchange file sizes (which is also the barrier);
3. rank 0 writes ``meta.pt`` with those sizes, renames the staging directory to the tag, then rewrites
   ``latest``; a last barrier returns when the tag is published.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ds_strategy.log import get_logger

from ..zero.per_tensor import WholeTensors
from . import rng
from .experts import expert_group_indices, expert_module_entries, gather_experts, moe_meta
from .format import (
    FORMAT,
    META,
    MODEL,
    VERSION,
    atomic_save,
    check_safe,
    rank_file,
    ranks,
)
from .frozen import frozen_names, packed_names, saved_layouts, saved_partitions
from .partition import saved_group
from .store import check_tag, write_tag
from .sync import agree, gather
from .target import CheckpointTarget

log = get_logger("ds_strategy.runtime.checkpoint")


def module_entries(engine: CheckpointTarget) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """(state-dict entries outside the stage's storage, {alias: layout name} of tied stored parameters, all
    state-dict keys in order). Flat parameters are saved as fp32 partitions (their compute-dtype copies
    are their cast, so they are not saved twice), stage 3's frozen ones as frozen partitions."""
    stored = [*engine.stage.groups, *getattr(engine.stage, "frozen", ())]
    flat_names = {id(p): name for gs in stored for name, p in zip(gs.names, gs.params, strict=True)}
    rest: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    keys: list[str] = []
    for key, value in engine.module.state_dict(keep_vars=True).items():
        keys.append(key)
        name = flat_names.get(id(value))
        if name is None:
            rest[key] = value.detach()
        elif name != key:
            aliases[key] = name
    return rest, aliases, keys


def _saved_entries(engine: CheckpointTarget, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    # An MoE model's expert entries (frozen parameters, buffers) are in the expert files ([Note: expert files]).
    experts = expert_module_entries(engine.module)
    rest = {k: v for k, v in module_entries(engine)[0].items() if k not in experts}
    left_out = _left_out(engine, exclude_frozen)
    return {k: v for k, v in rest.items() if k not in left_out}


def _left_out(engine: CheckpointTarget, exclude_frozen: bool) -> set[str]:
    """The frozen entries a checkpoint leaves out: all of them (``exclude_frozen_parameters``), else the packed
    ones: another library's quantized base is reloaded from its own files ([Note: packed parameters])."""
    return frozen_names(engine) if exclude_frozen else packed_names(engine)


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (lr, betas, weight decay ...) as a checkpoint saves them: the
    lr a scheduler wrote there, which the scheduler itself writes again only at its next step."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]


def _meta(engine: CheckpointTarget, tag: str, client_state: dict[str, Any], exclude_frozen: bool) -> dict[str, Any]:
    _, aliases, keys = module_entries(engine)
    rest = _saved_entries(engine, exclude_frozen)
    optimizer = engine.optimizer
    hyper = group_hyperparameters(optimizer) if optimizer is not None else [None] * len(engine.stage.groups)
    from ds_strategy._version import __version__

    experts = set(expert_group_indices(engine))
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "stage": engine.stage.stage,
        "world_size": engine.coll.world_size,
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "groups": [
            {"layout": gs.layout.to_dict(), "hyperparams": h}
            for g, (gs, h) in enumerate(zip(engine.stage.groups, hyper, strict=True))
            if g not in experts
        ],
        "moe_layers": moe_meta(engine.module),
        # [Note: expert files] in experts.py: expert param groups, in optimizer order among all groups
        "expert_groups": [
            {
                "index": g,
                "name": str(getattr(engine.stage.groups[g].params[0], "group_name", "")),
                "hyperparams": hyper[g],
            }
            for g in sorted(experts)
            if engine.stage.groups[g].params
        ],
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "module_entries": {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in rest.items()
        },
        "aliases": aliases,
        "frozen_groups": [] if exclude_frozen else saved_layouts(engine),
        "frozen_excluded": sorted(_left_out(engine, exclude_frozen)),
        "state_keys": keys,
        "counters": engine.counters.state_dict(),
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "client_state": client_state,
        "torch_version": str(torch.__version__),
        "ds_strategy_version": __version__,
        "files": {},
    }


def save_checkpoint(
    engine: CheckpointTarget,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    exclude_optimizer_states: bool = False,
) -> Path:
    """Write ``save_dir/<tag>`` (default tag ``global_step<N>``) from every rank; return the tag directory.
    ``exclude_frozen_parameters``: leave out every ``requires_grad=False`` parameter (an adapters-only
    checkpoint; see [Note: frozen parameters in checkpoints]). ``exclude_optimizer_states``: the weights
    (fp32 partitions) without the optimizer's state (Lightning's ``save_weights_only``)."""
    coll = engine.coll
    root = Path(save_dir)
    rank = coll.rank
    experts = set(expert_group_indices(engine))
    # Expert files (gathered over each expert group's communicator first: a collective on every rank).
    expert_files = agree(
        coll,
        lambda: gather_experts(engine, not exclude_optimizer_states, exclude_frozen_parameters),
        "save_checkpoint (gathering experts)",
    )

    def prepare() -> tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
        name = check_tag(str(tag) if tag is not None else f"global_step{engine.counters.global_steps}")
        state = {} if client_state is None else client_state
        check_safe(state, "client_state")
        ours = {
            "format": FORMAT,
            "version": VERSION,
            "rank": rank,
            "world_size": coll.world_size,
            "groups": [
                saved_group(gs, None if exclude_optimizer_states else engine.optimizer, _whole_of(engine, g))
                for g, gs in enumerate(engine.stage.groups)
                if g not in experts
            ],
            "frozen": [] if exclude_frozen_parameters else saved_partitions(engine),
            "rng": rng.capture(),
        }
        check_safe(ours, f"{rank_file(rank)}")
        if rank != 0:
            return name, ours, None, None
        meta = _meta(engine, name, state, exclude_frozen_parameters)
        meta["optimizer_states_excluded"] = exclude_optimizer_states
        check_safe(meta, f"{META} (scheduler or optimizer hyperparameters)")
        model = {
            "format": FORMAT,
            "version": VERSION,
            "module": {k: _own_copy(v) for k, v in _saved_entries(engine, exclude_frozen_parameters).items()},
        }
        check_safe(model, MODEL)
        return name, ours, meta, model

    name, ours, meta, model = agree(coll, prepare, "save_checkpoint (preparing)")
    name = _agreed_tag(engine, gather(coll, name))
    if engine.mid_accumulation and rank == 0:
        log.warning(
            "save_checkpoint at micro-step %d: the gradients accumulated so far are not saved",
            engine.counters.micro_steps,
        )

    def write(staging: Path) -> dict[str, int]:
        sizes = {rank_file(rank): atomic_save(ours, staging / rank_file(rank))}
        if model is not None:
            sizes[MODEL] = atomic_save(model, staging / MODEL)
        for fname, content in expert_files.items():
            check_safe(content, fname)
            sizes[fname] = atomic_save(content, staging / fname)
        return sizes

    final = write_tag(
        coll, root, name, write, meta, META, rank=rank, local_rank=engine.local_rank, save_latest=save_latest
    )
    if rank == 0:
        log.info("saved checkpoint %s (%s, stage %d)", final, ranks(coll.world_size), engine.stage.stage)
    return final


def _agreed_tag(engine: CheckpointTarget, tags: list[str]) -> str:
    """The tag every rank saves under (checkpoint.tag_validation, DeepSpeed's check that it is the same on
    every rank): "Fail" raises on every rank when they differ; "Warn" warns (rank 0) and "Ignore" says
    nothing, and both save under rank 0's tag: one complete checkpoint, never shards under several names."""
    if len(set(tags)) > 1:
        policy = engine.tag_validation
        if policy == "Fail":
            raise ValueError(
                f"save_checkpoint: the ranks passed different tags {tags} and checkpoint.tag_validation is "
                '"Fail"; pass the same tag on every rank'
            )
        if policy == "Warn" and engine.coll.rank == 0:
            log.warning(
                "save_checkpoint: the ranks passed different tags %s; saving under rank 0's tag %r "
                '(checkpoint.tag_validation "Warn"; pass the same tag on every rank)',
                tags,
                tags[0],
            )
    return tags[0]


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with its own storage (a view would save the whole storage it looks into)."""
    return t.detach().to("cpu", copy=True)


def _whole_of(engine: CheckpointTarget, group: int) -> WholeTensors | None:
    """The per-tensor optimizer's tensors when param group ``group`` is stepped whole (state saved by name)."""
    whole = engine.stage.whole
    return whole if whole is not None and group in whole.groups else None
