"""Start this node's ranks with torch.distributed's elastic agent (what ``torchrun`` runs), in process.

The agent gives each worker RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
watches them every ``monitor_interval`` seconds, stops the whole local group (``killpg`` of each worker's
own session, so grandchildren go too) when one fails, restarts it up to ``max_restarts`` times, and on
SIGTERM / SIGINT stops the workers before the launcher exits. Several nodes meet through the *static*
rendezvous: node 0's agent serves a TCPStore on MASTER_ADDR:MASTER_PORT and the others connect to it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.utils.api import macros
from torch.distributed.launcher.api import LaunchConfig, launch_agent

from .hostfile import Node
from .logs import RankLogs, tail

TAIL_LINES = 20


@dataclass(frozen=True)
class LocalJob:
    """This node's share of the job: its slots, where it stands among the nodes, and what to run."""

    node: Node
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    command: tuple[str, ...]  # the worker command line; "${local_rank}" is substituted per worker
    max_restarts: int = 0
    log_dir: str | None = None
    rdzv_timeout: int = 900


def worker_command(
    user_script: str,
    user_args: tuple[str, ...],
    *,
    module: bool = False,
    no_python: bool = False,
    no_local_rank: bool = False,
    local_rank: str = macros.local_rank,
) -> tuple[str, ...]:
    """``python -u script.py args --local_rank=N`` (DeepSpeed scripts parse ``--local_rank``)."""
    if no_python:
        cmd: tuple[str, ...] = (user_script, *user_args)
    elif module:
        cmd = (sys.executable, "-u", "-m", user_script, *user_args)
    else:
        cmd = (sys.executable, "-u", user_script, *user_args)
    return cmd if no_local_rank else (*cmd, f"--local_rank={local_rank}")


def prepare_environment(job: LocalJob) -> None:
    """Variables every local worker inherits beyond what the agent sets itself."""
    nproc = len(job.node.slots)
    # DeepSpeed's name for the local world size; torch's LOCAL_WORLD_SIZE is set by the agent.
    os.environ["LOCAL_SIZE"] = str(nproc)
    if not job.node.is_contiguous:
        # --include host:2,3 runs local ranks 0,1 on devices 2,3: renumber the visible devices.
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, job.node.slots))
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        # As torchrun: N ranks each spawning one thread per core would oversubscribe the CPU.
        os.environ["OMP_NUM_THREADS"] = "1"


def run_local(job: LocalJob) -> int:
    """Run this node's workers to completion; return the launcher's exit status (0 when all succeeded)."""
    prepare_environment(job)
    own_dir = job.log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="ds-launch-")) if own_dir else Path(job.log_dir or ".")
    logs = RankLogs(log_dir)
    config = LaunchConfig(
        min_nodes=job.num_nodes,
        max_nodes=job.num_nodes,
        nproc_per_node=len(job.node.slots),
        run_id=f"ds-launch-{job.master_port}",
        rdzv_backend="static",
        rdzv_endpoint=f"{job.master_addr}:{job.master_port}",
        rdzv_configs={"rank": job.node_rank, "timeout": job.rdzv_timeout},
        max_restarts=job.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs,
        log_line_prefix_template="[rank${rank}]:",
        shutdown_timeout=10,
    )
    entrypoint, *args = job.command
    try:
        launch_agent(config, entrypoint, list(args))
    except ChildFailedError as exc:
        return report_failure(exc, logs, show_paths=not own_dir)
    except (RendezvousError, DistError) as exc:
        # Node 0's agent serves the store: an unreachable address, a port in use or a missing node ends here.
        role = "serve" if job.node_rank == 0 else "reach"
        print(
            f"ds-launch: node {job.node_rank} could not {role} the rendezvous at {job.master_addr}:{job.master_port} "
            f"for {job.num_nodes} node(s) within {job.rdzv_timeout} s: {exc}",
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:
        print(f"ds-launch: received {exc.sigval.name}; stopped every worker of node {job.node_rank}", file=sys.stderr)
        return 128 + int(exc.sigval)
    finally:
        if own_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def root_cause(exc: ChildFailedError) -> int:
    """The global rank that failed first. Ranks the agent stopped afterwards die of its SIGTERM / SIGKILL, so a
    rank with an exit code of its own is preferred; ties go to the earliest failure, then the lowest rank."""
    failures = exc.failures
    own = [r for r, f in failures.items() if f.exitcode > 0] or list(failures)
    return min(own, key=lambda r: (failures[r].timestamp, r))


def report_failure(exc: ChildFailedError, logs: RankLogs, *, show_paths: bool) -> int:
    """Name the failed rank, its exit code and its last log lines; return that exit status for the launcher."""
    rank = root_cause(exc)
    failure = exc.failures[rank]
    code = failure.exitcode
    how = f"exited with code {code}" if code >= 0 else f"was killed by {failure.signal_name()}"
    print(f"ds-launch: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}", file=sys.stderr)
    out, err = logs.files.get(failure.local_rank, (None, None))
    for path, stream in ((err, "stderr"), (out, "stdout")):
        lines = tail(path, TAIL_LINES) if path is not None else []
        if lines:
            where = f" ({path})" if show_paths else ""  # a temporary log directory is gone by then
            print(f"ds-launch: last {len(lines)} lines of rank {rank}'s {stream}{where}:", file=sys.stderr)
            print("\n".join(f"    {line}" for line in lines), file=sys.stderr)
            break
    others = sorted(r for r in exc.failures if r != rank)
    if others:
        print(f"ds-launch: stopped the other ranks of this node: {others}", file=sys.stderr)
    # A signal death (-N) becomes 128+N as a shell reports it; an exit code above 255 cannot be passed on.
    return code if 0 < code < 256 else (128 - code if code < 0 else 1)
