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

# The runtime package's public names, as they are (one list: ``ds_strategy.runtime.pipe.__all__``).
from ds_strategy.runtime.pipe import *  # noqa: F403
from ds_strategy.runtime.pipe import __all__ as __all__
