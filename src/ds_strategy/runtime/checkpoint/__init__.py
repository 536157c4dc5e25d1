"""Sharded checkpoints of the ZeRO engine: save/load at any world size and stage, consolidation to fp32.

``ZeroEngine.save_checkpoint`` / ``load_checkpoint`` delegate here; docs/checkpointing.md describes the API
and the on-disk format.
"""

from __future__ import annotations

from .consolidate import (
    consolidate_fp32_state_dict,
    consolidate_optimizer_state,
    iter_fp32_state,
    lightning_checkpoint,
    write_fp32,
)
from .format import CheckpointError, check_safe, to_plain
from .load import load_checkpoint
from .save import save_checkpoint

__all__ = [
    "CheckpointError",
    "check_safe",
    "consolidate_fp32_state_dict",
    "consolidate_optimizer_state",
    "iter_fp32_state",
    "lightning_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "to_plain",
    "write_fp32",
]
