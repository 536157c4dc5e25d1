"""DeepSpeed-compatible configuration: validated once, typed everywhere.

``load_config`` accepts a dict, a JSON file or a ``DeepSpeedConfig`` and returns frozen dataclasses;
nothing outside this package reads a raw config dict. The JSON Schema shipped next to this file is
the source of truth for keys, types and defaults, and docs/config.md is generated from it
(``python -m ds_strategy.config.docgen > docs/config.md``).
"""

from __future__ import annotations

from .auto import AUTO
from .batch import BatchSizes, resolve_batch_sizes
from .context import ConfigContext, OnConflict, precision_kind
from .errors import (
    ConfigConflictWarning,
    ConfigDeprecationWarning,
    ConfigError,
    ConfigProblem,
    ConfigWarning,
    IgnoredConfigWarning,
)
from .frozen import FrozenDict
from .loader import check_config, find_problems, load_config
from .model import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CompileConfig,
    DataTypesConfig,
    DeepSpeedConfig,
    FlopsProfilerConfig,
    FP16Config,
    HybridEngineConfig,
    LeafModuleConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    ZeroConfig,
)
from .schema import load_schema

__all__ = [
    "AUTO",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "BatchSizes",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "CompileConfig",
    "ConfigConflictWarning",
    "ConfigContext",
    "ConfigDeprecationWarning",
    "ConfigError",
    "ConfigProblem",
    "ConfigWarning",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "FrozenDict",
    "HybridEngineConfig",
    "IgnoredConfigWarning",
    "LeafModuleConfig",
    "OffloadConfig",
    "OnConflict",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "check_config",
    "find_problems",
    "load_config",
    "load_schema",
    "precision_kind",
    "resolve_batch_sizes",
]
