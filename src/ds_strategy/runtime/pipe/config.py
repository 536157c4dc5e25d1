"""The ``pipeline`` config block applied to a ``PipelineModule`` (see config/support.py for each key)."""

from __future__ import annotations

from ds_strategy.config import ConfigError, DeepSpeedConfig

from ..activation_checkpointing import checkpoint, non_reentrant_checkpoint
from .module import PipelineModule


def apply_pipeline_config(module: PipelineModule, config: DeepSpeedConfig) -> DeepSpeedConfig:
    """Check ``pipeline.stages`` against the module; apply the checkpoint interval and re-entrancy."""
    block = config.pipeline
    if block.stages != "auto" and int(block.stages) != module.num_stages:
        raise ConfigError(
            [
                f"pipeline.stages={block.stages} but the PipelineModule has num_stages={module.num_stages}; "
                f'valid: {module.num_stages} or "auto"'
            ]
        )
    if block.activation_checkpoint_interval > 0:
        module.activation_checkpoint_interval = block.activation_checkpoint_interval
    if not block.use_reentrant and module.activation_checkpoint_func is checkpoint:
        module.activation_checkpoint_func = non_reentrant_checkpoint
    return config
