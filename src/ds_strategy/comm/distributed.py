"""``init_distributed``: make torch.distributed's default process group exist, the way DeepSpeed does.

    import ds_strategy
    info = ds_strategy.init_distributed()      # under torchrun, srun, mpirun, or a plain `python`
    info.rank, info.world_size, info.local_rank, info.backend, info.source

The default torch.distributed group is the real one: torchmetrics, Lightning and our ``Communicator`` all
communicate through it. The order (DeepSpeed's, extended):

1. ``existing``: torch.distributed is already initialised (by Lightning, torchrun + user code, a test
   harness): reuse it, change nothing.
2. ``init_method``: an explicit ``init_method`` other than ``env://`` (``tcp://host:port``, ``file://``)
   is passed to torch with ``rank`` and ``world_size``.
3. ``env``: RANK and WORLD_SIZE (or the ``rank`` / ``world_size`` arguments) and MASTER_ADDR are set, as
   torchrun, Lightning and ``ds-launch`` do. MASTER_PORT defaults to ``distributed_port``; LOCAL_RANK, if
   unset, comes from the launcher's own variable or from comparing host names across ranks.
4. ``mpi`` / ``launcher`` (``auto_mpi_discovery=True``): under an MPI launcher (OMPI_COMM_WORLD_*,
   PMI_*, PMIX_RANK or MV2_COMM_WORLD_* in the environment) with mpi4py importable, rank and size come
   from ``MPI.COMM_WORLD``, rank 0's address is broadcast and LOCAL_RANK is derived from host names.
   Without mpi4py the launcher's variables are read directly, by ds_strategy/scheduler_env.py (the
   launcher's bootstrap reads them there too): OpenMPI (also how Azure ML and SageMaker start MPI jobs;
   Azure's AZ_BATCH_MASTER_NODE / AZ_BATCHAI_MPI_MASTER_NODE name the master), MVAPICH, MPICH / Intel MPI
   and SLURM's ``srun`` (a batch script's own SLURM_PROCID is not a rank). The discovered values are
   written to RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, then torch initialises from them.
5. ``single``: none of the above: a one-process group on a free local port, so the same script runs
   alone. The environment is left untouched (a later Lightning Trainer must not think it was launched).

[Note: the fake process group]
torch's fake backend (``torch.testing._internal.distributed.fake_pg``:
``init_process_group("fake", store=FakeStore(), rank=r, world_size=N)``) makes one process rank ``r`` of
``N`` with no peer behind it: every collective returns at once, moving nothing (an all_reduce or broadcast
leaves the tensor as it was, an all_gather writes this rank's input into every rank's slot, a
reduce_scatter keeps this rank's slice of its own input). The real code then runs at world size N in one
process, so one device shows what each of N ranks does: its step time, the collectives it issues, its
memory. ds_strategy recognises the group by its backend name (``is_fake_group``; ``Communicator.is_fake``,
``Communicator.has_peers``) and steps aside where a peer would be needed: the shared-memory paths are
not opened (their first barrier would wait for peers that never come), collectives go through plain
torch.distributed (which the fake group answers), an existing fake group is reused (LOCAL_RANK defaults
to 0: every simulated rank computes on this process's device), ``init_distributed(dist_backend="fake",
rank=r, world_size=N)`` creates one, and the exit meeting through the store is skipped (the fake store
holds nothing). What a collective returns is therefore not the other ranks' data: checks comparing ranks
must not count on it (``has_peers`` is False). Its work objects never report themselves completed, even
once waited for; a ``Communicator`` does not keep them (waiting on them is a no-op), so its handles report
completion at once, as a real rank's do when its collectives land, and whatever polls them (stage 3's
reductions in flight) frees its buffers when a real rank would. docs/zero3.md has the recipe.

A partial environment (say RANK without WORLD_SIZE) that discovery cannot complete is an error naming the
missing variables. The timeout is the ``timeout`` argument (a ``timedelta`` or seconds), else
``$DS_STRATEGY_DIST_TIMEOUT`` (seconds), else torch's default. The backend is ``dist_backend``, else the
accelerator's: ``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on CUDA (so CPU tensors can be reduced too).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from ds_strategy import env
from ds_strategy.accelerator import get_accelerator
from ds_strategy.comm import ownership
from ds_strategy.comm.fake import FAKE_BACKEND, is_fake_backend
from ds_strategy.scheduler_env import (
    LOCAL_RANK_VARS,
    MPI_LAUNCHER_VARS,
    SchedulerEnvError,
    azure_master,
    read_scheduler,
)

log = logging.getLogger(__name__)

TIMEOUT_ENV = env.DIST_TIMEOUT
DEFAULT_PORT = 29500
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

Source = Literal["existing", "init_method", "env", "mpi", "launcher", "single", "fake"]


@dataclass(frozen=True)
class DistributedInfo:
    """What ``init_distributed`` found or made. ``group`` is torch.distributed's default group.

    ``source``: which step of the order above produced the group. ``local_rank`` is None only when an
    existing group was reused and LOCAL_RANK is not set. ``master_addr`` / ``master_port`` are None for
    reused groups and explicit ``init_method`` URLs.
    """

    rank: int
    world_size: int
    local_rank: int | None
    backend: str
    source: Source
    master_addr: str | None = None
    master_port: int | None = None
    timeout: datetime.timedelta | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None, "torch.distributed was destroyed after init_distributed"
        return group

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class _Found:
    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str | None
    master_port: int
    how: str


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
    *,
    set_device: bool = True,
) -> DistributedInfo:
    """Initialise (or reuse) torch.distributed's default process group; see the module docstring.

    ``set_device=False``: leave the current CUDA device alone (a caller that placed this rank itself, such
    as Lightning with ``Trainer(devices=[2, 3])``); by default it becomes ``cuda:LOCAL_RANK``, as in DeepSpeed.
    """
    pg_timeout = resolve_timeout(timeout)
    if dist.is_initialized():
        return _reuse(dist_backend, timeout, init_method)
    if dist_backend is not None and is_fake_backend(dist_backend):
        return _init_fake(rank, world_size, pg_timeout)

    accelerator = get_accelerator()
    device_type = accelerator.device_type if set_device else "none"  # _finish places only "cuda"
    backend = dist_backend or _default_backend(accelerator.communication_backend_name())

    if init_method is not None and not init_method.startswith("env://"):
        ownership.prepare_torch_defaults()
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=pg_timeout)
        info = DistributedInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=_local_rank_after_init(os.environ),
            backend=str(dist.get_backend()),
            source="init_method",
            timeout=pg_timeout,
        )
        return _finish(info, device_type)

    found, source = _from_env(os.environ, rank, world_size, distributed_port), "env"
    if found is None and auto_mpi_discovery:
        found = discover_mpi(os.environ, distributed_port)
        source = "launcher" if found is not None and found.how != "mpi4py" else "mpi"
    if found is None:
        _fail_if_partial(os.environ, rank, world_size, auto_mpi_discovery)
        return _init_single(backend, pg_timeout, device_type)

    _export(found)
    ownership.prepare_torch_defaults()
    dist.init_process_group(
        backend, init_method="env://", rank=found.rank, world_size=found.world_size, timeout=pg_timeout
    )
    local_rank = found.local_rank if found.local_rank is not None else _local_rank_after_init(os.environ)
    os.environ["LOCAL_RANK"] = str(local_rank)
    info = DistributedInfo(
        rank=found.rank,
        world_size=found.world_size,
        local_rank=local_rank,
        backend=str(dist.get_backend()),
        source=source,  # type: ignore[arg-type]
        master_addr=found.master_addr,
        master_port=found.master_port,
        timeout=pg_timeout,
    )
    return _finish(info, device_type, how=found.how)


def resolve_timeout(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """The argument (timedelta or seconds), else ``$DS_STRATEGY_DIST_TIMEOUT`` seconds, else None (torch's)."""
    if timeout is None:
        seconds = env.positive_number(TIMEOUT_ENV, "seconds")
        return None if seconds is None else datetime.timedelta(seconds=seconds)
    if isinstance(timeout, datetime.timedelta):
        if timeout.total_seconds() <= 0:
            raise ValueError(f"init_distributed(timeout={timeout!r}): the timeout must be positive")
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"init_distributed(timeout={timeout!r}): expected a datetime.timedelta or seconds")
    if timeout <= 0:
        raise ValueError(f"init_distributed(timeout={timeout!r}): the timeout must be positive")
    return datetime.timedelta(seconds=float(timeout))


# ---- the steps ---------------------------------------------------------------------------------------


def _reuse(dist_backend: str | None, timeout: object, init_method: str | None) -> DistributedInfo:
    backend = str(dist.get_backend())
    if dist_backend is not None and dist_backend not in backend:
        warnings.warn(
            f"init_distributed(dist_backend={dist_backend!r}) ignored: torch.distributed is already "
            f"initialised with backend {backend!r}",
            stacklevel=3,
        )
    ignored = [name for name, value in (("timeout", timeout), ("init_method", init_method)) if value is not None]
    if ignored:
        warnings.warn(
            f"init_distributed: {', '.join(ignored)} ignored because torch.distributed is already initialised",
            stacklevel=3,
        )
    local = os.environ.get("LOCAL_RANK")
    # A fake group's simulated ranks all compute on this process's device (see [Note: the fake process group]).
    alone = dist.get_world_size() == 1 or is_fake_backend(backend)
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(local) if local not in (None, "") else (0 if alone else None),
        backend=backend,
        source="existing",
    )


def _init_fake(rank: int, world_size: int, timeout: datetime.timedelta | None) -> DistributedInfo:
    """``init_distributed(dist_backend="fake", rank=r, world_size=N)``: this process as rank r of N, no peers."""
    if world_size < 1:
        raise ValueError(
            f"init_distributed(dist_backend={FAKE_BACKEND!r}): pass world_size (the number of ranks to simulate)"
        )
    rank = max(rank, 0)
    if rank >= world_size:
        raise ValueError(f"init_distributed: rank={rank} is outside [0, world_size={world_size})")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the backend

    ownership.prepare_torch_defaults()
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size, timeout=timeout)
    local = _int_env(os.environ, "LOCAL_RANK")
    info = DistributedInfo(
        rank=rank,
        world_size=world_size,
        local_rank=0 if local is None else local,
        backend=str(dist.get_backend()),
        source="fake",
        timeout=timeout,
    )
    return _finish(info, "none")


def _from_env(env: Mapping[str, str], rank: int, world_size: int, port: int) -> _Found | None:
    """RANK/WORLD_SIZE (or the arguments) + MASTER_ADDR; None unless all of them are known."""
    r = rank if rank >= 0 else _int_env(env, "RANK")
    w = world_size if world_size >= 1 else _int_env(env, "WORLD_SIZE")
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if w == 1 else None)
    if r is None or w is None or addr is None:
        return None
    if not 0 <= r < w:
        raise ValueError(f"init_distributed: RANK={r} is outside [0, WORLD_SIZE={w})")
    master_port = _int_env(env, "MASTER_PORT")
    return _Found(r, w, local_rank_from_env(env), addr, master_port or port, "env")


def discover_mpi(env: Mapping[str, str], port: int = DEFAULT_PORT) -> _Found | None:
    """Rank, size, local rank and master address from an MPI / SLURM launcher; None when not launched by one.

    mpi4py is used when an MPI launcher is detected and it imports (it initialises MPI); otherwise the
    launcher's environment variables are read.
    """
    if any(v in env for v in MPI_LAUNCHER_VARS):
        try:
            from mpi4py import MPI
        except ImportError:
            pass
        else:
            return _from_mpi4py(MPI.COMM_WORLD, env, port)
    return _from_launcher_env(env, port)


def _from_mpi4py(comm: object, env: Mapping[str, str], port: int) -> _Found:
    rank, size = int(comm.Get_rank()), int(comm.Get_size())  # type: ignore[attr-defined]
    host = socket.gethostname()
    hosts: list[str] = list(comm.allgather(host))  # type: ignore[attr-defined]
    proposal = None
    if rank == 0:
        addr = env.get("MASTER_ADDR") or azure_master(env)[0]
        if addr is None:
            addr = "127.0.0.1" if len(set(hosts)) == 1 else _host_address(host)
        proposal = (addr, _int_env(env, "MASTER_PORT") or port)
    addr, master_port = comm.bcast(proposal, root=0)  # type: ignore[attr-defined]
    return _Found(rank, size, hosts[:rank].count(hosts[rank]), str(addr), int(master_port), "mpi4py")


def _from_launcher_env(env: Mapping[str, str], port: int) -> _Found | None:
    try:
        found = read_scheduler(env)
    except SchedulerEnvError as exc:
        raise ValueError(f"init_distributed: {exc}") from None
    if found is None:
        return None
    name, size = found.scheme.name, found.world_size
    addr = found.master_addr
    if addr is None and (size == 1 or found.local_size == size):
        addr = "127.0.0.1"  # every rank on this node
    if addr is None:
        raise ValueError(
            f"init_distributed: found {name} launcher variables ({found.scheme.rank}={found.rank}, "
            f"{found.scheme.size}={size}) but cannot tell rank 0's address: set MASTER_ADDR (and MASTER_PORT), "
            "or install mpi4py so rank 0 broadcasts it"
        )
    return _Found(found.rank, size, found.local_rank, addr, found.master_port or port, name)


def _fail_if_partial(env: Mapping[str, str], rank: int, world_size: int, auto_mpi_discovery: bool) -> None:
    given = {
        "RANK": rank >= 0 or "RANK" in env,
        "WORLD_SIZE": world_size >= 1 or "WORLD_SIZE" in env,
        "MASTER_ADDR": "MASTER_ADDR" in env,
        "LOCAL_RANK": "LOCAL_RANK" in env,
    }
    if not any(given.values()):
        return
    present = [k for k, v in given.items() if v]
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if not given[k]]
    hint = "" if auto_mpi_discovery else " (auto_mpi_discovery=False, so no MPI/SLURM launcher was consulted)"
    raise ValueError(
        f"init_distributed: {', '.join(present)} set but {', '.join(missing)} missing{hint}. Launch with "
        "torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT), set the missing "
        "variables (MASTER_PORT defaults to distributed_port), or unset them all to run as a single process"
    )


def _init_single(backend: str, timeout: datetime.timedelta | None, device_type: str) -> DistributedInfo:
    # A store on an ephemeral port: no race for a "free" port between probing and binding.
    store_timeout = timeout or datetime.timedelta(minutes=5)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=store_timeout)
    ownership.prepare_torch_defaults()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    info = DistributedInfo(
        rank=0,
        world_size=1,
        local_rank=0,
        backend=str(dist.get_backend()),
        source="single",
        master_addr="127.0.0.1",
        master_port=int(store.port),
        timeout=timeout,
    )
    return _finish(info, device_type)


def _finish(info: DistributedInfo, device_type: str, how: str | None = None) -> DistributedInfo:
    ownership.created_default_group()  # the package made it: the package destroys it at a normal exit
    if device_type == "cuda" and info.local_rank is not None:
        accelerator = get_accelerator("cuda")
        if info.local_rank < accelerator.device_count():
            accelerator.set_device(info.local_rank)
    if info.rank == 0:
        via = info.source if how in (None, "env", "mpi4py") else f"{info.source} ({how})"
        where = f", master {info.master_addr}:{info.master_port}" if info.master_addr else ""
        log.info("init_distributed: %d process(es) via %s, backend %s%s", info.world_size, via, info.backend, where)
    return info


# ---- teardown ------------------------------------------------------------------------------------------
# The default group init_distributed creates is recorded as the package's (comm/ownership.py, [Note: clean
# exits by ownership]) and destroyed at a normal exit; a group it reuses is the caller's and is left alone.


def destroy_at_normal_exit() -> None:
    """Register the package's exit handler (idempotent). It releases only what the package created (see
    [Note: clean exits by ownership] in comm/ownership.py): a group the caller made is never destroyed."""
    ownership._register_exit_handler()


# ---- helpers -------------------------------------------------------------------------------------------


def _default_backend(accelerator_backend: str) -> str:
    # NCCL cannot reduce CPU tensors (offloaded state, metrics kept on CPU): pair it with gloo.
    return "cpu:gloo,cuda:nccl" if accelerator_backend == "nccl" else accelerator_backend


def _export(found: _Found) -> None:
    os.environ["RANK"] = str(found.rank)
    os.environ["WORLD_SIZE"] = str(found.world_size)
    os.environ["MASTER_ADDR"] = str(found.master_addr)
    os.environ["MASTER_PORT"] = str(found.master_port)
    if found.local_rank is not None:
        os.environ["LOCAL_RANK"] = str(found.local_rank)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"init_distributed: {name}={raw!r} is not an integer") from None


def local_rank_from_env(env: Mapping[str, str]) -> int | None:
    for name in ("LOCAL_RANK", *LOCAL_RANK_VARS):
        value = _int_env(env, name)
        if value is not None:
            return value
    return None


def _local_rank_after_init(env: Mapping[str, str]) -> int:
    """LOCAL_RANK from the environment, else by comparing host names through the default group's store."""
    local = local_rank_from_env(env)
    if local is not None:
        return local
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return 0
    store = dist.distributed_c10d._get_default_store()
    host = socket.gethostname()
    store.set(f"ds_strategy/hostname/{rank}", host)
    hosts = [store.get(f"ds_strategy/hostname/{r}").decode() for r in range(rank)]
    return hosts.count(host)


def _host_address(host: str) -> str:
    """This host's first non-loopback IPv4 address (what ``hostname -I`` lists first), else its name."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return host
    for info in infos:
        addr = str(info[4][0])
        if not addr.startswith("127."):
            return addr
    return host
