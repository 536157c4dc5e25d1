"""Every private name of Lightning the adapter uses, in one place.

Lightning does not promise these across releases; when one moves, this module is the only one to edit.
Each line says what it is for.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

# Precision plugin: casting a batch's floating tensors; the default dtype while a "-true" module is built.
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager

# The Fabric face: Fabric's launchers, and the strategy mixins Fabric checks for (no_backward_sync, init_module).
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher as _FabricMultiProcessingLauncher
from lightning.fabric.strategies.launchers import _SubprocessScriptLauncher as _FabricSubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded

# Collectives and process-group defaults, as Lightning's DDP strategy uses them.
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _suggested_max_num_threads,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group

# Whether we run in a notebook / REPL (fork the workers) or as a script (re-run it per rank).
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.types import _PATH

# The optimizers and schedulers of configure_optimizers, parsed as Lightning parses them.
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers, _MockOptimizer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

# Trainer.init_module at stage 3 starts the script's other ranks early (see ZeroStrategy.tensor_init_context).
from lightning.pytorch.strategies.launchers.subprocess_script import _launch_process_observer

__all__ = [
    "_IS_INTERACTIVE",
    "_PATH",
    "_BackwardSyncControl",
    "_DtypeContextManager",
    "_FabricMultiProcessingLauncher",
    "_FabricSubprocessScriptLauncher",
    "_MockOptimizer",
    "_MultiProcessingLauncher",
    "_Sharded",
    "_SubprocessScriptLauncher",
    "_WorkerOutput",
    "_convert_fp_tensor",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_group",
    "_init_optimizers_and_lr_schedulers",
    "_launch_process_observer",
    "_suggested_max_num_threads",
    "_sync_ddp_if_available",
    "train_dataloader_of",
]


def train_dataloader_of(trainer: pl.Trainer) -> Any:
    """The train dataloader the fit loop will use, built from its source (None when there is none)."""
    source = trainer.fit_loop._data_source
    return source.dataloader() if source.is_defined() else None
