"""``deepspeed.comm``'s one-line queries, for code that calls ``dist.get_rank()`` through DeepSpeed's module.

``get_rank`` / ``get_world_size`` / ``barrier`` take an optional group (default: the default group);
``get_local_rank`` reads LOCAL_RANK (or the MPI / SLURM local-rank variables) as DeepSpeed does. Before any
process group exists they raise, naming the call to make first, instead of torch's bare "Default process
group has not been initialized".
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ds_strategy.comm.distributed import local_rank_from_env


def is_initialized() -> bool:
    """Whether torch.distributed's default group exists (``init_distributed`` or the caller made it)."""
    return dist.is_available() and dist.is_initialized()


def _require(name: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"ds_strategy.comm.{name}(): torch.distributed is not initialised; call "
            "ds_strategy.init_distributed() (or ds_strategy.initialize(...)) first"
        )


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the default group)."""
    _require("get_rank")
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (default: the default group)."""
    _require("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (0 when none names it)."""
    local = local_rank_from_env(os.environ)
    return 0 if local is None else local


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` (default: the default group) has reached it."""
    _require("barrier")
    dist.barrier(group)
