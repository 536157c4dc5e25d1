"""Distributed runtime: process-group setup, the collectives facade, and the comms logger.

- ``init_distributed(...)`` -> ``DistributedInfo``: create or reuse torch.distributed's default group
  (torchrun / env variables, MPI or SLURM discovery, or a single process). See ``comm.distributed``.
- ``Communicator(group, *, logger=None, fast_path=None)``: all_reduce, reduce_scatter_tensor,
  all_gather_into_tensor, broadcast, barrier, coalesced variants; async handles; routing of CPU float
  reductions to the shared-memory fast path. See ``comm.collectives``.
- ``GroupSet(owner)``: the process groups an object creates, destroyed by its ``close()``/``destroy()``
  and at a normal exit; the package never destroys a group it did not create. See ``comm.ownership``.
- ``get_rank()``, ``get_world_size()``, ``get_local_rank()``, ``barrier()``, ``is_initialized()``: the
  ``deepspeed.comm`` queries, with a clear error before any group exists. See ``comm.queries``.
- ``CommsLogger(config.comms_logger)``: per-op counts, bytes, latency, algorithm / bus bandwidth and the
  path taken; ``log_summary()`` prints a table. See ``comm.logger``.

Under torch's fake process group (one process simulating rank r of N, no peers) ``is_fake_group()`` is
True, communicators report ``has_peers`` False and skip the shared-memory paths (see [Note: the fake
process group] in ``comm.distributed``).

Environment variables: ``DS_STRATEGY_DIST_TIMEOUT`` (seconds, init timeout), ``DS_STRATEGY_SHM=0``
(disable the shared-memory fast path), plus the launcher variables listed in ``comm.distributed``.
"""

from __future__ import annotations

from ds_strategy.comm.collectives import SHM_ENV, CommHandle, Communicator, FastPath, reduce_op_name
from ds_strategy.comm.distributed import (
    TIMEOUT_ENV,
    DistributedInfo,
    destroy_at_normal_exit,
    init_distributed,
    resolve_timeout,
)
from ds_strategy.comm.fake import is_fake_backend, is_fake_group
from ds_strategy.comm.logger import CommsLogger, CommsStat, bus_factor
from ds_strategy.comm.ownership import GroupSet
from ds_strategy.comm.queries import barrier, get_local_rank, get_rank, get_world_size, is_initialized

__all__ = [
    "SHM_ENV",
    "TIMEOUT_ENV",
    "CommHandle",
    "CommsLogger",
    "CommsStat",
    "Communicator",
    "DistributedInfo",
    "FastPath",
    "GroupSet",
    "barrier",
    "bus_factor",
    "destroy_at_normal_exit",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_fake_backend",
    "is_fake_group",
    "is_initialized",
    "reduce_op_name",
    "resolve_timeout",
]
