"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``): ``PipelineModule`` + ``PipelineEngine``.

module.py: layers, specs, partitioning and tie groups; topology.py: rank grids; partition.py: the
partition methods; schedule.py: 1F1B; p2p.py: stage-to-stage transport and failure notices; engine.py:
the PipelineEngine; checkpoint.py: per-rank checkpoints (read without an engine by
runtime/checkpoint/pipe_files.py, whose ``pipe_state_dict`` is re-exported here). See docs/pipeline.md.
"""

from __future__ import annotations

from ..checkpoint.pipe_files import pipe_state_dict
from .engine import PipelineEngine
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .p2p import PipelineStageError
from .schedule import bubble_fraction, train_schedule
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineModule",
    "PipelineStageError",
    "ProcessTopology",
    "TiedLayerSpec",
    "bubble_fraction",
    "pipe_state_dict",
    "train_schedule",
]
