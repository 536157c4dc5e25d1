"""Everything ZeRO stage 3 changes in the Lightning adapter, in one place.

Stage 3 partitions the parameters themselves, so three things differ from stages 0-2:

- ``configure_model`` builds the model under ``ds_strategy.zero.Init`` (each rank materialises only its
  shard) instead of on the root device;
- checkpoints never gather: every rank writes its shards (``engine.save_checkpoint``), and the weights in
  Lightning's checkpoint dict are the module's own state dict (placeholders for partitioned weights);
- at teardown the full weights are assembled once, bucket by bucket, on rank 0's CPU (what a notebook
  kernel gets back after ``fit``), and the engine hands each rank's shards back to the module as
  ``zero.Init`` would have left them, so ``validate``/``test`` after ``fit`` build a new engine from them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine


@contextmanager
def sharded_init(raw_config: Mapping[str, Any]) -> Iterator[None]:
    """Modules created inside are partitioned as they are built (stage 3's ``configure_model``)."""
    from ds_strategy.zero import Init

    with Init(config_dict_or_path=dict(raw_config)):
        yield


def final_weights(engine: ZeroEngine) -> dict[str, Any]:
    """At teardown, while every rank is still here: the full weights on rank 0's CPU, assembled one
    bucket at a time (a collective; the other ranks get ``{}``). What a notebook kernel gets back after
    ``fit`` and what ``lightning_module_state_dict()`` returns once the engine is gone."""
    return engine.full_state_dict(rank=0)
