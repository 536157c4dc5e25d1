"""Everything ZeRO stage 3 changes in the Lightning adapter, in one place.

Stage 3 partitions the parameters themselves, so three things differ from stages 0-2:

- ``configure_model`` builds the model under ``ds_strategy.zero.Init`` (each rank materialises only its
  shard) instead of on the root device;
- checkpoints never gather: every rank writes its shards (``engine.save_checkpoint``), and the weights in
  Lightning's checkpoint dict are the module's own state dict (placeholders for partitioned weights);
- at teardown the full weights are assembled once, bucket by bucket, on rank 0's CPU (what a notebook
  kernel gets back after ``fit``), and the engine hands each rank's shards back to the module as
  ``zero.Init`` would have left them, so ``validate``/``test`` after ``fit`` build a new engine from them.

Until the stage-3 engine is merged, ``stage_available(3)`` is False and a stage-3 ``ZeroStrategy`` fails
at setup with ``STAGE3_MISSING``; the tests skip with that reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine

STAGE3_MISSING = "stage 3 engine not merged yet"


def stage_available(stage: int) -> bool:
    """Whether the engine implements ZeRO ``stage``."""
    from ds_strategy.runtime.zero import STAGES

    return stage in STAGES


def require_stage(stage: int) -> None:
    if not stage_available(stage):
        raise NotImplementedError(
            f"ZeroStrategy(stage={stage}): this build's engine does not implement ZeRO stage {stage} "
            f"({STAGE3_MISSING}); use stage 0, 1 or 2"
        )


@contextmanager
def sharded_init(raw_config: Mapping[str, Any]) -> Iterator[None]:
    """Modules created inside are partitioned as they are built (stage 3's ``configure_model``)."""
    require_stage(3)
    from ds_strategy.zero import Init  # lands with the stage-3 engine

    with Init(config_dict_or_path=dict(raw_config)):
        yield


def final_weights(engine: ZeroEngine) -> dict[str, Any]:
    """At teardown, while every rank is still here: the full weights on rank 0's CPU, assembled one
    bucket at a time (a collective; the other ranks get ``{}``). What a notebook kernel gets back after
    ``fit`` and what ``lightning_module_state_dict()`` returns once the engine is gone."""
    return engine.full_state_dict(rank=0)
