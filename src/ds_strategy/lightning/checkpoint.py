"""Lightning checkpoints through the engine's sharded format (see docs/lightning.md, "Checkpoints"): one
engine's checkpoint under a Lightning path (``save_engine`` / ``load_engine``), for both faces.

[Note: what goes where]
Lightning builds one checkpoint dict (``dump_checkpoint``): the weights (``state_dict``), the optimizer
states, the lr scheduler states, and the trainer's own state (loops, callbacks, epoch, global step,
hyperparameters, precision plugin). With ZeRO the weights and the optimizer state are partitioned across
ranks, so:

- the engine saves what it owns, sharded per rank: fp32 master partitions, optimizer state, counters,
  RNG states (``engine.save_checkpoint(path, tag=TAG)``; the Lightning checkpoint path is a directory);
- everything else of Lightning's dict rides along as the engine's client state (``client_state``). That
  includes ``lr_schedulers``: Lightning, not the engine, steps the schedulers (step or epoch interval, see
  ``ZeroStrategy._adopt_config_scheduler``), so Lightning restores them too, from the same dict it would
  read for DDP; the engine's own scheduler slot is empty and nothing is stepped twice.

Loading runs after setup (``restore_checkpoint_after_setup``), when the engine exists: the engine loads the
weights and the optimizer state and returns the client state, which Lightning restores as usual.

A single file (a DDP checkpoint, ``ds-zero-to-fp32 --lightning`` output, a ZeroStrategy checkpoint from
before sharded checkpoints) holds full weights but no partitioned optimizer state: its weights are
written into the engine's fp32 masters, and a torch optimizer state it holds (DDP's) is cut into the
partitions (``engine.load_full_optimizer_state``, [Note: importing an unpartitioned optimizer state]).
Where there is none, or it does not fit, the optimizer's state starts fresh (a warning says so) and only
its param groups' hyperparameters (lr, betas, weight decay) are the file's (``restore_hyperparameters``),
so that the first step after the resume runs at the saved schedule's lr, not the initial one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine

# The one tag inside every Lightning checkpoint directory (as Lightning's DeepSpeedStrategy does).
TAG = "checkpoint"
# Saved by the engine itself, so left out of the client state.
ENGINE_KEYS = ("state_dict", "optimizer_states")


def client_state(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict minus what the engine saves, as plain containers (``weights_only``-safe)."""
    from ds_strategy.runtime.checkpoint import to_plain

    return to_plain({k: v for k, v in checkpoint.items() if k not in ENGINE_KEYS})


def locate(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """(checkpoint directory, tag) for a Lightning checkpoint path: the directory ``save_checkpoint`` wrote
    (tag from its ``latest`` file), or the tag directory inside it."""
    root = Path(path)
    if (root / "meta.pt").is_file() and not (root / "latest").is_file():
        return root.parent, root.name
    return root, None


def is_single_file(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_file()


def save_engine(
    engine: ZeroEngine,
    path: str | os.PathLike[str],
    checkpoint: Mapping[str, Any],
    *,
    exclude_frozen_parameters: bool = False,
    exclude_optimizer_states: bool = False,
) -> None:
    """Every rank writes its shards under ``path/<TAG>`` (engine format, docs/checkpointing.md), with the rest
    of Lightning's ``checkpoint`` dict as the client state."""
    engine.save_checkpoint(
        path,
        tag=TAG,
        client_state=client_state(checkpoint),
        exclude_frozen_parameters=exclude_frozen_parameters,
        exclude_optimizer_states=exclude_optimizer_states,
    )


def load_engine(
    engine: ZeroEngine, path: str | os.PathLike[str], *, load_optimizer_states: bool, load_module_only: bool
) -> dict[str, Any]:
    """Load what ``save_engine`` wrote (at any world size and stage: the engine reshards); return the
    client state. ``path`` is the directory or the tag directory inside it."""
    load_dir, tag = locate(path)
    _, state = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=False,  # schedulers belong to the Lightning side, restored from the state
        load_module_only=load_module_only,
    )
    return state


def is_engine_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory ``save_engine`` wrote (or its tag directory)."""
    root = Path(path)
    return (root / "latest").is_file() or (root / "meta.pt").is_file()


def restore_hyperparameters(optimizer: Any, saved: Mapping[str, Any]) -> bool:
    """Set ``optimizer``'s param groups' hyperparameters from a single file's saved optimizer state ``saved``
    (torch's ``state_dict()``: the lr a scheduler wrote there, which the scheduler itself only writes again at
    its next step). False when the groups do not pair up (the caller says so)."""
    from ds_strategy.runtime.checkpoint.load import copy_hyperparameters

    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        return False
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        copy_hyperparameters(group, saved_group)
    return True
