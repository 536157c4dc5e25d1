"""Everything ZeRO stage 3 changes in the Lightning adapter, in one place.

Stage 3 partitions the parameters themselves, so three things differ from stages 0-2:

- ``configure_model`` builds the model under ``ds_strategy.zero.Init`` (each rank materialises only its
  shard) instead of on the root device;
- checkpoints never gather: every rank writes its shards (``engine.save_checkpoint``), and the weights in
  Lightning's checkpoint dict are the module's own state dict (placeholders for partitioned weights);
- at teardown the engine hands each rank's shards back to the module as ``zero.Init`` would have left them,
  so ``validate``/``test`` after ``fit`` build a new engine from them; the full weights are assembled from
  those shards, one parameter at a time on rank 0's CPU, only when asked for (``lightning_module_state_dict``
  after the run: a notebook kernel's weights after ``fit``, ``trainer.save_checkpoint``), never by default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def sharded_init(raw_config: Mapping[str, Any]) -> Iterator[None]:
    """Modules created inside are partitioned as they are built (stage 3's ``configure_model``)."""
    from ds_strategy.zero import Init

    with Init(config_dict_or_path=dict(raw_config)):
        yield


def released_weights(module: torch.nn.Module, rank: int = 0) -> dict[str, Any]:
    """After teardown: the full weights of ``module``, whose partitioned parameters are ``zero.Init`` shards
    again, on ``rank``'s CPU (the other ranks get ``{}``). A collective, one parameter at a time: every rank
    calls it, and no rank ever holds more than one full parameter beyond what it keeps."""
    import torch.distributed as dist

    from ds_strategy.runtime.zero.init import gather_init_param, init_shard

    keep = not dist.is_initialized() or dist.get_rank() == rank
    gathered: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        info = init_shard(value) if isinstance(value, torch.Tensor) else None
        if info is not None and id(value) not in gathered:
            full = gather_init_param(value).view(info.shape)
            gathered[id(value)] = full.detach().to("cpu", copy=True) if keep else full[:0]
        if not keep:
            continue
        if info is not None:
            out[name] = gathered[id(value)]
        else:
            out[name] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return out
