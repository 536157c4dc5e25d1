"""Activation checkpointing with DeepSpeed's API (``ds_strategy.checkpointing`` is the public name).

options.py: ``configure`` / ``is_configured`` (the config block and overrides); rng.py: random-state
replay and the model-parallel tracker; stash.py: how a checkpoint keeps its inputs (partitioned, on the
host, in contiguous buffers); checkpoint.py: the reentrant and non-reentrant checkpoints; policy.py:
checkpointing chosen submodules in place (Lightning's ``activation_checkpointing_policy``).
"""

from __future__ import annotations

from .checkpoint import checkpoint, non_reentrant_checkpoint, profile_report
from .options import ModelParallelUnit, configure, is_configured, settings, unconfigure
from .policy import Policy, apply_activation_checkpointing, is_checkpointed
from .rng import RNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from .stash import BUFFERS


def reset() -> None:
    """Rewind the contiguous buffers (``contiguous_memory_optimization``) for the next forward; the engine
    calls it at every forward. Call it yourself between forwards without the engine."""
    BUFFERS.reset()


__all__ = [
    "ModelParallelUnit",
    "Policy",
    "RNGStatesTracker",
    "apply_activation_checkpointing",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_checkpointed",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "profile_report",
    "reset",
    "settings",
    "unconfigure",
]
