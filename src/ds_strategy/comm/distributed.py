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
must not count on it (``has_peers`` is False). docs/zero3.md has the recipe.

A partial environment (say RANK without WORLD_SIZE) that discovery cannot complete is an error naming the
missing variables. The timeout is the ``timeout`` argument (a ``timedelta`` or seconds), else
``$DS_STRATEGY_DIST_TIMEOUT`` (seconds), else torch's default. The backend is ``dist_backend``, else the
accelerator's: ``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on CUDA (so CPU tensors can be reduced too).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import inspect
import logging
import os
import socket
import sys
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

from ds_strategy import env
from ds_strategy.accelerator import get_accelerator
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
FAKE_BACKEND = "fake"  # torch's fake process group (torch.testing._internal.distributed.fake_pg)
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

Source = Literal["existing", "init_method", "env", "mpi", "launcher", "single", "fake"]


def is_fake_backend(backend: str) -> bool:
    """Whether ``backend`` (a name as ``dist.get_backend`` gives it, ``"fake"`` or a device map such as
    ``"cpu:fake,cuda:fake"``) is torch's fake process group (see [Note: the fake process group])."""
    return any(item.split(":", 1)[-1].strip().lower() == FAKE_BACKEND for item in str(backend).split(","))


def is_fake_group(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default group) is a fake process group: one process, no peers behind it."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):  # not a member of ``group``, or no default group after all
        return False
    return is_fake_backend(str(backend))


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
        raw = (env.get(TIMEOUT_ENV) or "").strip()
        if not raw:
            return None
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        if seconds <= 0:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
        return datetime.timedelta(seconds=seconds)
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
    destroy_at_normal_exit()
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
    return _Found(r, w, _local_rank_from_env(env), addr, master_port or port, "env")


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
    destroy_at_normal_exit()
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
# [Note: destroying the group at exit]
# A script that never calls destroy_process_group() leaves gloo's worker threads to interpreter
# finalisation, and a rank can then abort after a successful run ("terminate called without an active
# exception", SIGABRT; pytorch/pytorch#190489), which a launcher reports as a failed rank. The group this
# module created is therefore destroyed by an atexit handler - only on a normal exit: after an uncaught
# exception another rank may still be inside a collective, and tearing down then can block (torchtitan
# destroys only after success for the same reason). A group the caller made is destroyed the same way once
# ds_strategy runs on it (init_distributed reusing it, or an engine built on it): the abort does not care
# who created the group, and a script's own destroy_process_group() before exit leaves nothing to do.

_exit_state = {"registered": False}


def destroy_at_normal_exit() -> None:
    """Destroy the default process group at a normal interpreter exit (see the note above); idempotent."""
    if _exit_state["registered"]:
        return
    _exit_state["registered"] = True
    atexit.register(_destroy_if_clean)


def _exiting_after_uncaught_exception() -> bool:
    # The interpreter keeps an uncaught exception in sys.last_value (and sys.last_exc from 3.12) before it
    # runs the atexit handlers: no sys.excepthook wrapper needed, which would outlive the group it served.
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


# [Note: leaving together]
# Measured with tests/comm/scripts/uneven_exit.py (one rank works on after training): 2 aborts in ~170
# launches even with the group destroyed at exit, and always on the rank that reached exit FIRST, while its
# peer was still alive. So the ranks also meet before tearing down: each marks its exit in the group's
# store and waits (bounded: EXIT_WAIT_ENV seconds, default 300) until every rank has, then all destroy the
# group at the same moment, as ranks that finish together do. A peer that crashed never marks: the wait
# times out (or the launcher ends this rank first), then the group is destroyed as before.
EXIT_WAIT_ENV = env.EXIT_WAIT


def _destroy_if_clean() -> None:
    if _exiting_after_uncaught_exception():
        return
    if not dist.is_initialized():  # the script destroyed its groups itself: torch may still hold them
        _release_quietly(_groups_in_torch_defaults())
        return
    try:
        _meet_peers_before_teardown()
        groups = list(dist.distributed_c10d._world.pg_map)  # the default group and every new_group
        dist.destroy_process_group()
    except Exception as err:  # at exit: report, never raise
        log.debug("init_distributed: destroying the process group at exit failed: %s", err)
        return
    _release_quietly(groups)


def _release_quietly(groups: list[Any]) -> None:
    try:
        released = release_group_references(groups)
        log.debug("exit: dropped %d reference(s) to the destroyed process groups", released)
    except Exception as err:  # never worse off than without: the groups then die in finalisation
        log.debug("exit: dropping references to the destroyed process groups failed: %s", err)
    groups.clear()
    gc.collect()  # the groups die here, their gloo threads joined while the interpreter is whole


# [Note: dropping references to destroyed groups]
# destroy_process_group() only unregisters the groups: gloo joins a group's threads when the last
# reference to it dies. Whatever still holds one (an engine's communicator or MoE/tensor-parallel
# subgroup, a hook's closure, the script's own ``pg = dist.new_group(...)``) keeps it, and its threads,
# alive into interpreter finalisation, where they are torn down with the interpreter half gone: the abort
# this section exists to prevent. Measured: after destroy_process_group() in this handler the gloo threads
# of any engine-built run were still alive. One holder is torch itself: torch.distributed.nn.functional
# writes ``group=group.WORLD`` as default argument values, evaluated at import, and torch.optim imports it
# lazily (through torch._dynamo), usually after the group exists. So, after destroying them, every
# reference to those groups is replaced with None (None is the default group in every torch.distributed
# signature; the groups are unusable by then anyway), and the last reference dies inside this handler.
# A group held only from C++, from slots or from a tuple nothing mutable holds stays; it is no worse off.
# The slow pass over every object is for containers the collector does not track: a process group is a
# pybind11 object, not tracked, so a dict holding only strings and groups is invisible to get_referrers.
# Seen: FSDP2's DeviceMesh keeps such a dict ({'0': group}) in an attribute (measured 2026-11-27; DDP and
# DeepSpeed's engines at stages 2 and 3 need only the fast passes).


def release_group_references(groups: list[Any]) -> int:
    """Replace references to ``groups`` (process groups already destroyed) with None; return how many.

    Covers default argument values of torch.distributed functions, and the attributes, dict entries and
    keys, list items, closure cells and tuples held by those that refer to a group. See [Note: dropping
    references to destroyed groups].
    """
    targets = [g for g in groups if isinstance(g, dist.ProcessGroup)]
    if not targets:
        return 0
    ids = {id(g) for g in targets}
    replaced = _release_torch_defaults(ids)

    def still_held() -> bool:
        return any(sys.getrefcount(g) > 4 for g in targets)  # the two lists, the loop, the call

    if still_held():  # the direct holders, found by a traversal in C
        for holder in gc.get_referrers(*targets):
            if holder is not groups and holder is not targets:
                replaced += _drop_from(holder, ids)
    if not still_held():
        return replaced
    for obj in gc.get_objects():  # slow: a container of untracked objects is only seen from its holder
        if obj is groups or obj is targets:
            continue
        for ref in gc.get_referents(obj):
            if id(ref) in ids or (type(ref) is tuple and any(id(v) in ids for v in ref)):
                replaced += _drop_from(obj, ids)
                break
            if type(ref) is dict and not gc.is_tracked(ref):
                replaced += _drop_from(ref, ids)
    return replaced


def _without_groups(value: object, ids: set[int]) -> object:
    """None for a group, a tuple with None in place of its groups, else ``value`` itself."""
    if id(value) in ids:
        return None
    if type(value) is tuple and any(id(v) in ids for v in value):
        return tuple(None if id(v) in ids else v for v in value)
    return value


def _holds_group(namespace: dict[Any, Any], ids: set[int]) -> bool:
    return any(id(k) in ids or _without_groups(v, ids) is not v for k, v in namespace.items())


def _drop_from(holder: object, ids: set[int]) -> int:
    replaced = 0
    if isinstance(holder, dict) and not _holds_group(holder, ids):  # the common case, and cheap
        return 0
    if isinstance(holder, dict) and (owner := _type_owning(holder)) is not None:
        for name, value in list(holder.items()):  # through setattr: the type's attribute cache is updated
            if (clean := _without_groups(value, ids)) is not value:
                setattr(owner, name, clean)
                replaced += 1
    elif isinstance(holder, dict):
        for key in [k for k in holder if id(k) in ids]:  # a cache keyed by group
            del holder[key]
            replaced += 1
        for key, value in list(holder.items()):
            if (clean := _without_groups(value, ids)) is not value:
                holder[key] = clean
                replaced += 1
    elif isinstance(holder, list):
        for i, value in enumerate(holder):
            if (clean := _without_groups(value, ids)) is not value:
                holder[i] = clean
                replaced += 1
    elif isinstance(holder, types.CellType):
        try:
            value = holder.cell_contents
        except ValueError:  # an empty cell
            return 0
        if (clean := _without_groups(value, ids)) is not value:
            holder.cell_contents = clean
            replaced += 1
    elif isinstance(holder, types.FunctionType):
        replaced += _release_defaults(holder, ids)
    elif hasattr(holder, "__dict__") and not isinstance(holder, (type, types.ModuleType)):
        try:
            for name, value in list(vars(holder).items()):
                if (clean := _without_groups(value, ids)) is not value:
                    object.__setattr__(holder, name, clean)  # past a guarding __setattr__ (nn.Module)
                    replaced += 1
        except (AttributeError, TypeError):  # a read-only mapping, slots: left as is
            pass
    return replaced


def _type_owning(namespace: dict[Any, Any]) -> type | None:
    """The class whose namespace ``namespace`` is (written to only through setattr), else None."""
    return next((t for t in gc.get_referrers(namespace) if isinstance(t, type) and t.__dict__ == namespace), None)


def _release_torch_defaults(ids: set[int]) -> int:
    return sum(_release_defaults(fn, ids) for fn in _torch_distributed_functions())


def _groups_in_torch_defaults() -> list[Any]:
    """Process groups held as default argument values by torch.distributed functions (no duplicates)."""
    found: dict[int, Any] = {}
    for fn in _torch_distributed_functions():
        for value in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            if isinstance(value, dist.ProcessGroup):
                found[id(value)] = value
    return list(found.values())


def _torch_distributed_functions() -> list[types.FunctionType]:
    """The functions of the loaded torch.distributed modules and of their classes (unwrapped)."""
    functions = []
    with warnings.catch_warnings():  # touching deprecated module attributes (reduce_op) warns
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith("torch.distributed"):
                continue
            for value in list(vars(module).values()):
                for member in (value, *vars(value).values()) if isinstance(value, type) else (value,):
                    try:
                        fn = inspect.unwrap(member) if callable(member) else member  # a functools.wraps original
                    except Exception:  # a __wrapped__ cycle, an attribute lookup that raises: not a function
                        continue
                    if isinstance(fn, types.FunctionType):
                        functions.append(fn)
    return functions


def _release_defaults(fn: types.FunctionType, ids: set[int]) -> int:
    replaced = 0
    if fn.__defaults__ and (clean := _without_groups(fn.__defaults__, ids)) is not fn.__defaults__:
        replaced += sum(id(v) in ids for v in fn.__defaults__)
        fn.__defaults__ = clean  # type: ignore[assignment]  # a tuple, as given
    if fn.__kwdefaults__:
        replaced += _drop_from(fn.__kwdefaults__, ids)
    return replaced


def _meet_peers_before_teardown() -> None:
    world = dist.get_world_size()
    if world == 1 or is_fake_group():  # a fake group has no peers to meet, and its store holds nothing
        return
    seconds = float(env.get(EXIT_WAIT_ENV) or "300")
    if seconds <= 0:
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"ds_strategy/exit/{dist.distributed_c10d._get_default_group().group_name}"
    store.set(f"{prefix}/{dist.get_rank()}", "1")
    try:
        store.wait([f"{prefix}/{r}" for r in range(world)], datetime.timedelta(seconds=seconds))
    except Exception as err:  # a peer that failed or works on for longer: tear down alone, as before
        log.warning("exit: not every rank reached exit within %gs (%s); leaving without them", seconds, err)


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


def _local_rank_from_env(env: Mapping[str, str]) -> int | None:
    for name in ("LOCAL_RANK", *LOCAL_RANK_VARS):
        value = _int_env(env, name)
        if value is not None:
            return value
    return None


def _local_rank_after_init(env: Mapping[str, str]) -> int:
    """LOCAL_RANK from the environment, else by comparing host names through the default group's store."""
    local = _local_rank_from_env(env)
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
