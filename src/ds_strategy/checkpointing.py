"""``ds_strategy.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` (activation checkpointing).

- ``checkpoint(function, *args)`` / ``non_reentrant_checkpoint(function, *args)``: recompute in backward.
- ``configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
  num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None)``, ``is_configured()``,
  ``reset()``.
- ``get_cuda_rng_tracker()``, ``model_parallel_cuda_manual_seed(seed)``: model-parallel random states.
- ``apply_activation_checkpointing(module, policy)``: checkpoint chosen submodules in place.

See docs/activation_checkpointing.md.
"""

from __future__ import annotations

# The runtime package's public names, as they are (one list: ``ds_strategy.runtime.activation_checkpointing.__all__``).
from ds_strategy.runtime.activation_checkpointing import *  # noqa: F403
from ds_strategy.runtime.activation_checkpointing import __all__ as __all__
