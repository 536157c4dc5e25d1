"""Which scheduler started this process, and the ranks it gave, read from its environment variables.

One torch-free module for both readers: ``init_distributed`` (comm/distributed.py, which must guess
whether a process is a rank at all) and the launcher's bootstrap (launcher/bootstrap.py, run by mpirun or
srun, so certainly a rank). Schemes, tried in this order:

- OpenMPI: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE / _NODE_RANK;
- MVAPICH: MV2_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE;
- MPICH / Intel MPI: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS;
- SLURM (srun): SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_NODEID and the node's entry of
  SLURM_STEP_TASKS_PER_NODE as the local size.

SLURM: sbatch sets SLURM_PROCID / SLURM_NTASKS for the batch script itself, which is one process, not a
rank of a job-wide world; only srun sets the step's SLURM_STEP_NUM_TASKS, so that is what makes a SLURM
rank. A process known to be an srun task (``srun_task=True``: the bootstrap) also accepts the job's
SLURM_NTASKS and SLURM_TASKS_PER_NODE. The master address: MASTER_ADDR, else Azure ML's master node
(AZ_BATCH_MASTER_NODE "host:port", or AZ_BATCHAI_MPI_MASTER_NODE), else under SLURM the first host of
SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST; the port: MASTER_PORT, else Azure's.
SLURM's compressed host lists and task counts (``node[01-03,7],gpu-a`` / ``2(x3),1``) are expanded here,
without scontrol.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# Variables whose presence means "started by an MPI launcher" (OpenMPI, MPICH/Intel hydra, PMIx, MVAPICH).
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {text!r}: unbalanced ']' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM node list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def expand_nodelist(text: str) -> list[str]:
    """``node[01-03,7],gpu-a`` -> ``['node01', 'node02', 'node03', 'node7', 'gpu-a']`` (zero padding kept)."""
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for rng in ranges.split(","):
            m = _RANGE_RE.match(rng)
            if m is None:
                raise ValueError(f"SLURM node list {text!r}: {rng!r} is not N or N-M")
            lo, hi = m.group(1), m.group(2) or m.group(1)
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                for tail in expand_nodelist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{n:0{width}d}{tail}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` as one count per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part.strip())
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r}: {part!r} is not N or N(xM)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    return expand_nodelist(nodelist)[0]


class SchedulerEnvError(ValueError):
    """The scheduler's variables are incomplete or malformed."""


@dataclass(frozen=True)
class Scheme:
    name: str  # "openmpi" | "mvapich" | "pmi" | "slurm"
    title: str  # for messages
    rank: str
    size: str
    local_rank: str
    local_size: str  # SLURM: a tasks-per-node list, indexed by the node
    node: str | None = None
    job_size: str | None = None  # SLURM: the job's task count, for a process known to be an srun task
    job_local_size: str | None = None


SCHEMES = (
    Scheme(
        "openmpi",
        "OpenMPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        node="OMPI_COMM_WORLD_NODE_RANK",
    ),
    Scheme(
        "mvapich",
        "MVAPICH",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    Scheme("pmi", "MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Scheme(
        "slurm",
        "SLURM",
        "SLURM_PROCID",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_LOCALID",
        "SLURM_STEP_TASKS_PER_NODE",
        node="SLURM_NODEID",
        job_size="SLURM_NTASKS",
        job_local_size="SLURM_TASKS_PER_NODE",
    ),
)
LOCAL_RANK_VARS = tuple(s.local_rank for s in SCHEMES)
_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@dataclass(frozen=True)
class SchedulerRanks:
    """What the scheduler says about this process (None: it does not say)."""

    scheme: Scheme
    rank: int
    world_size: int
    local_rank: int | None
    local_size: int | None
    node_rank: int | None
    master_addr: str | None
    master_port: int | None


def read_scheduler(env: Mapping[str, str], *, srun_task: bool = False, complete: bool = False) -> SchedulerRanks | None:
    """The ranks of the first scheme whose rank and world-size variables are set; None without one.

    ``complete``: the local rank and local size must be there too (the bootstrap exports them), and a
    scheme whose rank variable alone is set is an error naming the missing variable, not "no scheduler".
    """
    for scheme in SCHEMES:
        size_var = scheme.size
        local_size_var = scheme.local_size
        if size_var not in env and srun_task and scheme.job_size is not None:
            size_var, local_size_var = scheme.job_size, scheme.job_local_size or local_size_var
        if scheme.rank not in env or (size_var not in env and not complete):
            continue
        rank = _int(env, scheme.rank, scheme, required=True)
        size = _int(env, size_var, scheme, required=True)
        assert rank is not None and size is not None
        local_rank = _int(env, scheme.local_rank, scheme, required=complete)
        node = _int(env, scheme.node, scheme, required=complete and scheme.name == "slurm") if scheme.node else None
        local_size = _local_size(env, local_size_var, scheme, node, required=complete)
        addr, port = _master(env, scheme)
        return SchedulerRanks(scheme, rank, size, local_rank, local_size, node, addr, port)
    return None


def azure_master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """Azure ML's master node: AZ_BATCH_MASTER_NODE ("host:port", multi-node) or AZ_BATCHAI_MPI_MASTER_NODE."""
    node = env.get("AZ_BATCH_MASTER_NODE")
    if node:
        host, _, port = node.partition(":")
        return host, int(port) if port.isdigit() else None
    return env.get("AZ_BATCHAI_MPI_MASTER_NODE") or None, None


def _master(env: Mapping[str, str], scheme: Scheme) -> tuple[str | None, int | None]:
    port = _int(env, "MASTER_PORT", scheme, required=False)
    addr = env.get("MASTER_ADDR") or None
    if addr is None:
        addr, az_port = azure_master(env)
        port = port or az_port
    if addr is None and scheme.name == "slurm":
        nodelist = next((env[v] for v in _NODELISTS if env.get(v)), None)
        addr = first_host(nodelist) if nodelist else None
    return addr, port


def _local_size(env: Mapping[str, str], var: str, scheme: Scheme, node: int | None, *, required: bool) -> int | None:
    raw = env.get(var)
    if raw is None:
        if required:
            raise SchedulerEnvError(f"{scheme.title} started this process but {var} is not set")
        return None
    if scheme.name != "slurm":
        return _int(env, var, scheme, required=required)
    counts = expand_tasks_per_node(raw)
    if node is None:
        return counts[0] if len(counts) == 1 else None
    if node >= len(counts):
        raise SchedulerEnvError(f"SLURM_NODEID={node} but {var} lists {len(counts)} nodes")
    return counts[node]


def _int(env: Mapping[str, str], var: str, scheme: Scheme, *, required: bool) -> int | None:
    raw = env.get(var)
    if raw is None or raw.strip() == "":
        if required:
            raise SchedulerEnvError(f"{scheme.title} started this process but {var} is not set")
        return None
    try:
        return int(raw)
    except ValueError:
        raise SchedulerEnvError(f"{var}={raw!r} is not an integer") from None
