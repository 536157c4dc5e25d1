"""Pipeline parallelism (DeepSpeed's ``deepspeed.pipe``): ``PipelineModule`` + ``PipelineEngine``.

module.py: layers, specs, partitioning and tie groups; topology.py: rank grids; partition.py: the
partition methods; schedule.py: 1F1B; p2p.py: stage-to-stage transport and failure notices; engine.py:
the PipelineEngine; checkpoint.py: per-layer checkpoints. See docs/pipeline.md.
"""

from __future__ import annotations

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
    "train_schedule",
]
