"""DeepSpeed-compatible configuration: validated once, typed everywhere.

``load_config`` accepts a dict, a JSON file or a ``DeepSpeedConfig`` and returns frozen dataclasses;
nothing outside this package reads a raw config dict. The JSON Schema shipped next to this file is
the source of truth for keys, types and defaults, and docs/config.md is generated from it
(``python -m ds_strategy.config.docgen > docs/config.md``).
"""

from __future__ import annotations

from . import errors, model
from .auto import AUTO
from .batch import BatchSizes, resolve_batch_sizes
from .context import ConfigContext, OnConflict, precision_kind
from .errors import *  # noqa: F403
from .frozen import FrozenDict
from .loader import check_config, find_problems, load_config
from .model import *  # noqa: F403
from .schema import load_schema

# This package's own names, then the config objects and the problem / warning classes as model.py and
# errors.py list them (one list each).
__all__ = [
    "AUTO",
    "BatchSizes",
    "ConfigContext",
    "FrozenDict",
    "OnConflict",
    "check_config",
    "find_problems",
    "load_config",
    "load_schema",
    "precision_kind",
    "resolve_batch_sizes",
]
__all__ += errors.__all__
__all__ += model.__all__
