"""Everything ZeRO stage 3 changes in the Lightning adapter, in one place.

Stage 3 partitions the parameters themselves, so three things differ from stages 0-2:

- ``configure_model`` builds the model under ``ds_strategy.zero.Init`` (each rank materialises only its
  shard) instead of on the root device;
- a full state dict (checkpoint weights, the weights a notebook kernel gets back after ``fit``) needs the
  shards gathered on every rank (``ds_strategy.zero.GatheredParameters``);
- before the engine is released at teardown, the full weights are gathered once, because afterwards the
  module only holds this rank's shards.

Until the stage-3 engine is merged, ``stage_available(3)`` is False and a stage-3 ``ZeroStrategy`` fails
at setup with ``STAGE3_MISSING``; the tests skip with that reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

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


def full_state_dict(module: nn.Module, stage: int) -> dict[str, Any]:
    """The module's full state dict; collective under stage 3 (call it on every rank)."""
    if stage < 3:
        return module.state_dict()
    from ds_strategy.zero import GatheredParameters

    with GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in module.state_dict().items()}
