"""``ds_strategy.pipe``: DeepSpeed's ``deepspeed.pipe`` (pipeline parallelism).

- ``PipelineModule(layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False, seed_fn=None,
  base_seed=1234, partition_method="parameters", activation_checkpoint_interval=0,
  activation_checkpoint_func=checkpoint, checkpointable_layers=None)``
- ``LayerSpec(cls, *args, **kwargs)``, ``TiedLayerSpec(key, cls, *args, forward_fn=None,
  tied_weight_attr="weight", **kwargs)``
- ``ProcessTopology(axes, dims)``, ``PipeDataParallelTopology(num_pp, num_dp)``,
  ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)``
- ``ds_strategy.initialize(model=PipelineModule, ...)`` returns a ``PipelineEngine``.

See docs/pipeline.md.
"""

from __future__ import annotations

from ds_strategy.runtime.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineEngine,
    PipelineModule,
    PipelineStageError,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
    bubble_fraction,
    train_schedule,
)

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
