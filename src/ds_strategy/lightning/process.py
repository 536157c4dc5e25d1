"""This process's place in the job, as both Lightning faces answer it.

- the compute device of a rank (``compute_device``) and the default process group, initialised from a
  Lightning cluster environment (torchelastic, SLURM, LSF, MPI, plain: ``init_process_group``);
- ``ProcessLayout``, mixed into ``ZeroStrategy`` and ``ZeroFabricStrategy``: devices, ranks, the sampler's
  arguments, the process group and the object collectives Lightning asks a strategy for;
- torch's fake process group, initialised by the user before fit: one process (``devices=1``) stands for
  rank r of N (see [Note: one process for N ranks]).

Nothing here imports ``lightning.pytorch``: the Fabric face must not need the Trainer's modules.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from ds_strategy.accelerator import get_accelerator
from ds_strategy.comm import init_distributed, is_fake_group

from ._compat import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _group,
    _sync_ddp_if_available,
)

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine

T = TypeVar("T")


# ---------------------------------------------------------------------- device and process group
def compute_device(device: torch.device) -> torch.device:
    """The device a rank computes on: Lightning's CPU devices are plain "cpu"; the device-strict mode
    computes on "cpu:0" (strict.py), so the CPU is asked of the accelerator."""
    return get_accelerator("cpu").device() if device.type == "cpu" else device


def default_backend(device: torch.device) -> str:
    """The torch.distributed backend when the user chose none: nccl on CUDA, gloo on CPU."""
    return _get_default_process_group_backend_for_device(device)


def init_process_group(env: ClusterEnvironment, backend: str, timeout: timedelta | None) -> None:
    """torch.distributed's default group from Lightning's cluster environment (torchelastic, SLURM, LSF,
    MPI, plain); a group that already exists (an earlier fit, a user's own) is reused."""
    if is_fake_group():  # nothing to rendezvous with: no address to publish (see [Note: one process for N ranks])
        init_distributed(set_device=False)
        return
    # env:// (not tcp://) so that under torchrun the workers join the elastic agent's store.
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    # Reusing a group: only a timeout the user chose is worth a warning that it cannot apply any more.
    reused_default = torch.distributed.is_initialized() and timeout == default_pg_timeout
    init_distributed(
        dist_backend=backend,
        rank=env.global_rank(),
        world_size=env.world_size(),
        timeout=None if reused_default else timeout,
        set_device=False,  # Lightning placed this rank on its device (devices=[2, 3] is not LOCAL_RANK)
    )


# [Note: one process for N ranks]
# torch's fake process group ([Note: the fake process group] in comm/distributed.py), initialised before
# fit with ``init_process_group("fake", store=FakeStore(), rank=r, world_size=N)``, lets one process run what
# rank r of N does. Lightning launches that one process (``devices=1``) and would count a world of one; the
# strategy instead takes the group's rank and size (``fake_ranks``) for everything that depends on them:
# Lightning's global rank and world size (so rank_zero_only is rank r's), the DistributedSampler (rank r's
# 1/N of the data), the engine's config (train_batch_size = micro x accumulation x N) and its process
# group (the fake one). Collectives return at once with this rank's own data, so an object broadcast
# returns the caller's object and a boolean decision is this rank's (every simulated rank decides alike);
# tensor reductions through ``reduce`` run and their values are not the other ranks'. ``devices`` above 1
# with a fake group is an error: the other processes could not join it.


def fake_ranks(num_processes: int) -> tuple[int, int] | None:
    """(rank, world size) of the fake process group this process stands in for (see [Note: one process for
    N ranks]); None without one. ``num_processes``: the processes Lightning runs (must be 1 then)."""
    if not is_fake_group():
        return None
    if num_processes != 1:
        raise ValueError(
            f"torch.distributed is initialised with the fake backend (one process standing for "
            f"{torch.distributed.get_world_size()} ranks), but Lightning would run {num_processes} processes: "
            "use devices=1 and num_nodes=1 with a fake process group"
        )
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


class ProcessLayout:
    """What the Trainer and Fabric faces answer alike about this process's place in the job (put before
    Lightning's ParallelStrategy in the bases): devices, ranks, the sampler, the process group, collectives."""

    if TYPE_CHECKING:  # provided by Lightning's ParallelStrategy
        parallel_devices: list[torch.device] | None
        cluster_environment: ClusterEnvironment | None
        local_rank: int
        global_rank: int
        node_rank: int
        _num_nodes: int
        _process_group_backend: str | None
        _timeout: timedelta | None

        @property  # provided by the face (core.py's ZeroFace)
        def sequence_parallel_size(self) -> int: ...

    def layout_process_group(self, backend: str | None, timeout: timedelta | None) -> None:
        """The strategy's ``process_group_backend`` and ``timeout`` keywords (one node until Lightning says
        otherwise); called from the strategy's ``__init__``."""
        self._num_nodes = 1
        self._process_group_backend = backend
        self._timeout = timeout

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return compute_device(self.parallel_devices[self.local_rank])

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        fake = fake_ranks(self.num_nodes * self.num_processes)
        rank, ranks = fake if fake is not None else (self.global_rank, self.num_nodes * self.num_processes)
        # The ranks of a sequence-parallel group (consecutive) read the same samples: one replica per group.
        sp = self.sequence_parallel_size
        return {"num_replicas": ranks // sp, "rank": rank // sp}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        from lightning_utilities.core.rank_zero import rank_zero_only

        fake = fake_ranks(self.num_nodes * self.num_processes)
        if self.cluster_environment is not None and fake is not None:
            self.cluster_environment.set_global_rank(fake[0])
            self.cluster_environment.set_world_size(fake[1])
        elif self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def start_process_group(self) -> None:
        """Ranks, then the default process group (the backend the device takes unless one was named)."""
        self.set_world_ranks()
        if is_fake_group():
            self._process_group_backend = str(torch.distributed.get_backend())
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout)

    def live_engines(self) -> list[ZeroEngine]:
        """The engines this strategy runs now (ZeroStrategy: its one; ZeroFabricStrategy: every set-up model's)."""
        return []

    def meet_peers(self, what: str) -> None:
        """Before each collective below: a rank still inside a stage-3 forward its peers skipped raises with
        them at once instead of each waiting on another transport (ZeroEngine.meet_peers)."""
        for engine in self.live_engines():
            engine.meet_peers(what)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.meet_peers("barrier")
        barrier(self.root_device)

    def reduce_tensor(self, tensor: T, group: Any | None = None, reduce_op: Any = "mean") -> T:
        """A tensor reduced over the ranks as Lightning's DDP does it (``self.log(sync_dist=True)``,
        torchmetrics: the Trainer's ``reduce``, Fabric's ``all_reduce``); anything else as it is."""
        if isinstance(tensor, torch.Tensor):
            self.meet_peers("reduce")
            return cast(T, _sync_ddp_if_available(tensor, group, reduce_op=reduce_op))
        return tensor

    def broadcast(self, obj: T, src: int = 0) -> T:
        self.meet_peers("broadcast")
        return broadcast_object(obj, src)

    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        self.meet_peers("all_gather")
        base: Any = super()
        return base.all_gather(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if is_fake_group():  # every simulated rank decides as this one does (see [Note: one process for N ranks])
            return bool(decision)
        base: Any = super()
        return bool(base.reduce_boolean_decision(decision, all=all))


# ---------------------------------------------------------------------- collectives
def barrier(device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl" and device.type == "cuda":
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    # A fake group moves nothing: the other ranks' broadcast would leave this rank's list unsized garbage.
    if not _distributed_is_initialized() or is_fake_group():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]
