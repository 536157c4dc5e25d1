"""What ``configure()`` sets: the process-wide activation-checkpointing options, as DeepSpeed keeps them.

``configure(mpu_, deepspeed_config=..., **overrides)`` reads the config's ``activation_checkpointing``
block (a dict, a JSON path or a loaded ``DeepSpeedConfig``), then applies the explicit arguments on top.
``initialize()`` calls it for a config that has the block, so the block acts without a Megatron-style
explicit call. Options without meaning on this machine (partitioning without a model-parallel group,
CPU checkpointing when the activations already live on the CPU) are reported once on rank 0; the second
is noticed by the first checkpoint that sees host inputs (stash.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch.distributed as dist

from ds_strategy.config import ActivationCheckpointingConfig, DeepSpeedConfig, load_config

log = logging.getLogger("ds_strategy")


class ModelParallelUnit(Protocol):
    """The part of Megatron's ``mpu`` that activation partitioning reads."""

    def get_model_parallel_rank(self) -> int: ...
    def get_model_parallel_world_size(self) -> int: ...
    def get_model_parallel_group(self) -> Any: ...


@dataclass(frozen=True)
class Settings:
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


class _State:
    def __init__(self) -> None:
        self.settings = Settings()
        self.mpu: ModelParallelUnit | None = None
        self.configured = False
        self.told: set[str] = set()


STATE = _State()


def _block(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    if isinstance(deepspeed_config, DeepSpeedConfig):
        return deepspeed_config.activation_checkpointing
    world = dist.get_world_size() if dist.is_initialized() else 1
    return load_config(deepspeed_config, world_size=world).activation_checkpointing


def configure(
    mpu_: ModelParallelUnit | None = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the options ``checkpoint`` and ``non_reentrant_checkpoint`` use (DeepSpeed's signature).

    ``deepspeed_config``: a config dict, a JSON file path or a ``DeepSpeedConfig`` whose
    ``activation_checkpointing`` block gives the defaults; the other arguments override it when not None.
    """
    s = Settings()
    if deepspeed_config is not None:
        block = _block(deepspeed_config)
        s = Settings(
            partition_activations=block.partition_activations,
            contiguous_checkpointing=block.contiguous_memory_optimization,
            num_checkpoints=block.number_checkpoints,
            checkpoint_in_cpu=block.cpu_checkpointing,
            synchronize=block.synchronize_checkpoint_boundary,
            profile=block.profile,
        )
    overrides: dict[str, Any] = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    s = replace(s, **{k: v for k, v in overrides.items() if v is not None})
    if s.contiguous_checkpointing and not s.partition_activations:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization (contiguous_checkpointing) copies the "
            "partitioned activations into one buffer and needs partition_activations: true"
        )
    if s.contiguous_checkpointing and not s.num_checkpoints:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization needs number_checkpoints (num_checkpoints): "
            "the number of checkpointed calls per forward, which sizes the contiguous buffer"
        )
    STATE.settings, STATE.mpu, STATE.configured = s, mpu_, True
    _explain(s, mpu_)


def _explain(s: Settings, mpu: ModelParallelUnit | None) -> None:
    """Say once (rank 0) which options have nothing to act on here; they are still honoured where they can be."""
    if s.partition_activations and (mpu is None or mpu.get_model_parallel_world_size() == 1):
        tell_once(
            "partition",
            "activation_checkpointing.partition_activations splits each checkpoint's inputs across the ranks of "
            "a model-parallel group; without one (no mpu, or a model-parallel size of 1) every rank keeps its "
            "whole inputs, as in DeepSpeed (see docs/activation_checkpointing.md)",
        )


def tell_once(key: str, message: str) -> None:
    if key in STATE.told:
        return
    STATE.told.add(key)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(message)


def is_configured() -> bool:
    """True once ``configure()`` ran (``initialize()`` runs it for a config with the block)."""
    return STATE.configured


def settings() -> Settings:
    return STATE.settings


def model_parallel() -> ModelParallelUnit | None:
    mpu = STATE.mpu
    if mpu is None or mpu.get_model_parallel_world_size() == 1:
        return None
    return mpu


def unconfigure() -> None:
    """Back to the defaults (tests; a new ``initialize()`` without the block)."""
    STATE.settings, STATE.mpu, STATE.configured = Settings(), None, False
    STATE.told.clear()
