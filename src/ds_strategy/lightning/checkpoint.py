"""Lightning checkpoints through the engine's sharded format (see docs/lightning.md, "Checkpoints").

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
written into the engine's fp32 masters and the optimizer starts fresh (a warning says so).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

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


@torch.no_grad()
def load_full_weights(engine: ZeroEngine, state_dict: Mapping[str, Any], strict: bool, where: str) -> None:
    """Write a full (unpartitioned) state dict into the engine: every rank fills its fp32 masters from it,
    then publishes them into the parameters; buffers and frozen parameters are copied as they are."""
    from ds_strategy.runtime.checkpoint import CheckpointError
    from ds_strategy.runtime.checkpoint.save import module_entries

    stage = engine.stage
    rest, aliases, keys = module_entries(engine)
    missing = [k for k in keys if k not in state_dict and aliases.get(k) not in state_dict]
    unexpected = [k for k in state_dict if k not in keys]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where} does not match the model: missing keys {missing[:10]}, unexpected keys {unexpected[:10]} "
            "(set LightningModule.strict_loading = False to load a subset)"
        )
    for name, target in rest.items():
        if name in state_dict:
            _check_shape(state_dict[name], target.shape, name, where)
            target.copy_(state_dict[name])
    for gs in stage.groups:
        full32 = torch.zeros(gs.layout.total, dtype=torch.float32, device=gs.masters[0].device if gs.masters else None)
        known = torch.zeros(len(gs.names), dtype=torch.bool)
        for i, name in enumerate(gs.names):
            value = state_dict.get(name)
            if value is None:
                value = next((state_dict[a] for a, n in aliases.items() if n == name and a in state_dict), None)
            if value is None:  # only when not strict: keep the current value
                continue
            view = gs.layout.param_view(full32, i)
            _check_shape(value, view.shape, name, where)
            view.copy_(value)
            known[i] = True
        for b, master in enumerate(gs.masters):
            lo, hi = gs.master_range(b)
            if bool(known.all()):
                master.data.copy_(full32[lo:hi])
            else:  # a partial load: overwrite only the parameters the state dict holds
                for i in known.nonzero().flatten().tolist():
                    slot = gs.layout.params[i]
                    a, z = max(lo, slot.offset), min(hi, slot.end)
                    if a < z:
                        master.data[a - lo : z - lo].copy_(full32[a:z])
    stage.publish()
    stage.zero_grad()


def _check_shape(value: Any, shape: torch.Size, name: str, where: str) -> None:
    from ds_strategy.runtime.checkpoint import CheckpointError

    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CheckpointError(f"{where}: {name!r} is {got} in the checkpoint, {list(shape)} in the model")
