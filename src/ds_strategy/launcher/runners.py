"""Command lines that start a job on several hosts: ssh, pdsh, mpirun (OpenMPI, MPICH) and srun.

Two families:
- ssh / pdsh start one ``ds-launch`` per host (``python -m ds_strategy.launcher --world_info PLAN
  --node_rank R ...``); that node-local launcher runs torch's elastic agent, which starts the node's ranks.
- mpirun / srun start every rank themselves; each rank runs ``ds_strategy.launcher.bootstrap``, which turns
  the scheduler's variables into RANK / LOCAL_RANK / WORLD_SIZE / ... before running the script.
Every runner only *builds* argv lists (tested by comparing them); ``supervise.py`` runs them.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .hostfile import HostfileError, WorldPlan


@dataclass(frozen=True)
class RemoteJob:
    """Everything a runner needs to build its command lines."""

    plan: WorldPlan
    master_addr: str
    master_port: int
    user_script: str
    user_args: tuple[str, ...] = ()
    exports: Mapping[str, str] = field(default_factory=dict)
    python: str = "python3"
    cwd: str = "."
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    log_dir: str | None = None
    max_restarts: int = 0
    launcher_args: tuple[str, ...] = ()
    ssh_port: int | None = None


@dataclass(frozen=True)
class Command:
    """One process the supervisor starts: argv plus variables to add to the launcher's own environment."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


def _node_launcher_argv(job: RemoteJob, node_rank: str) -> list[str]:
    """``python -m ds_strategy.launcher`` for one node, told the whole plan and its own place in it."""
    argv = [
        job.python,
        "-u",
        "-m",
        "ds_strategy.launcher",
        "--launcher=torchrun",
        f"--world_info={job.plan.encode()}",
        f"--node_rank={node_rank}",
        f"--num_nodes={job.plan.num_nodes}",
        f"--master_addr={job.master_addr}",
        f"--master_port={job.master_port}",
        f"--max_restarts={job.max_restarts}",
    ]
    if job.log_dir:
        argv.append(f"--log_dir={job.log_dir}")
    argv += [
        flag
        for flag, on in (
            ("--no_local_rank", job.no_local_rank),
            ("--module", job.module),
            ("--no_python", job.no_python),
        )
        if on
    ]
    return [*argv, job.user_script, *job.user_args]


def _remote_shell(job: RemoteJob, node_rank: str) -> str:
    """The shell line a remote host runs: cd to the same directory, export the variables, start ds-launch."""
    exports = " ".join(f"export {k}={shlex.quote(v)};" for k, v in job.exports.items())
    launch = " ".join(shlex.quote(a) for a in _node_launcher_argv(job, node_rank))
    return f"cd {shlex.quote(job.cwd)} && {exports} {launch}".replace("  ", " ")


def ssh_commands(job: RemoteJob) -> list[Command]:
    """One ``ssh HOST '...'`` per host; ``-tt`` so that closing the connection hangs up the remote launcher."""
    port = ["-p", str(job.ssh_port)] if job.ssh_port else []
    return [
        Command(
            ("ssh", "-tt", "-o", "BatchMode=yes", *port, *job.launcher_args, node.host, _remote_shell(job, str(rank)))
        )
        for rank, node in enumerate(job.plan.nodes)
    ]


def pdsh_commands(job: RemoteJob) -> list[Command]:
    """One ``pdsh -w h1,h2 '...'``: pdsh replaces ``%n`` by each host's position in the -w list (its node rank)."""
    # -tt as for ssh: when pdsh is stopped, the remote shell gets a hangup and its launcher stops the workers.
    env = {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-tt" + (f" -p {job.ssh_port}" if job.ssh_port else "")}
    argv = ("pdsh", "-S", "-f", "1024", "-w", ",".join(job.plan.hosts), *job.launcher_args, _remote_shell(job, "%n"))
    return [Command(argv, env)]


def _bootstrap_argv(job: RemoteJob) -> list[str]:
    if job.no_python:
        raise HostfileError("--no_python cannot be used with mpirun / srun: they start Python ranks via bootstrap")
    flags = [f for f, on in (("--no_local_rank", job.no_local_rank), ("--module", job.module)) if on]
    return [job.python, "-u", "-m", "ds_strategy.launcher.bootstrap", *flags, job.user_script, *job.user_args]


def _require_prefix_slots(job: RemoteJob, launcher: str) -> None:
    for node in job.plan.nodes:
        if not node.is_contiguous:
            raise HostfileError(
                f"{launcher} places ranks itself and cannot pick devices {list(node.slots)} on {node.host!r}; "
                "use --launcher ssh or pdsh for --include/--exclude of single devices"
            )


def _ranks_per_host(job: RemoteJob, launcher: str, option: str) -> int:
    """The one rank count of every host, which ``launcher``'s ``option`` states; each host's slots contiguous."""
    _require_prefix_slots(job, launcher)
    ppn = job.plan.uniform_procs()
    if ppn is None:
        raise HostfileError(
            f"{option} needs the same number of ranks on every host; got "
            + ", ".join(f"{n.host}={len(n.slots)}" for n in job.plan.nodes)
        )
    return ppn


def _rendezvous_env(job: RemoteJob) -> dict[str, str]:
    """What every rank is given: the rendezvous address and port, then the exported variables."""
    return {"MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port), **job.exports}


def openmpi_commands(job: RemoteJob) -> list[Command]:
    """``mpirun -n W -H h1:s1,h2:s2 -x K=V ... python -m ds_strategy.launcher.bootstrap script args``."""
    _require_prefix_slots(job, "mpirun")
    hosts = ",".join(f"{n.host}:{len(n.slots)}" for n in job.plan.nodes)
    env = _rendezvous_env(job)
    exports = [arg for k, v in env.items() for arg in ("-x", f"{k}={v}")]
    argv = (
        "mpirun",
        "-n",
        str(job.plan.world_size),
        "-H",
        hosts,
        "--wdir",
        job.cwd,
        *exports,
        *job.launcher_args,
        *_bootstrap_argv(job),
    )
    return [Command(argv)]


def mpich_commands(job: RemoteJob) -> list[Command]:
    """``mpirun -n W -ppn P -hosts h1,h2 -genv K V ... python -m ds_strategy.launcher.bootstrap script args``."""
    ppn = _ranks_per_host(job, "mpirun (MPICH)", "MPICH's -ppn")
    env = _rendezvous_env(job)
    exports = [arg for k, v in env.items() for arg in ("-genv", k, v)]
    argv = (
        "mpirun",
        "-n",
        str(job.plan.world_size),
        "-ppn",
        str(ppn),
        "-hosts",
        ",".join(job.plan.hosts),
        *exports,
        *job.launcher_args,
        *_bootstrap_argv(job),
    )
    return [Command(argv)]


def slurm_commands(job: RemoteJob, *, nodelist: bool = True) -> list[Command]:
    """``srun --nodes N --ntasks W --ntasks-per-node P [--nodelist h1,h2] python -m ...bootstrap script args``.

    srun hands its whole environment to the tasks (``--export=ALL``, its default), so the exports travel
    as variables of the srun process, where values with commas or spaces need no quoting.
    """
    ppn = _ranks_per_host(job, "srun", "srun --ntasks-per-node")
    hosts = ["--nodelist", ",".join(job.plan.hosts)] if nodelist else []
    argv = (
        "srun",
        f"--nodes={job.plan.num_nodes}",
        f"--ntasks={job.plan.world_size}",
        f"--ntasks-per-node={ppn}",
        *hosts,
        f"--chdir={job.cwd}",
        *job.launcher_args,
        *_bootstrap_argv(job),
    )
    env = _rendezvous_env(job)
    if not job.master_addr:
        del env["MASTER_ADDR"]  # unknown before srun allocates: each rank takes the first host (bootstrap.py)
    return [Command(argv, env)]


RUNNERS: dict[str, Callable[[RemoteJob], list[Command]]] = {
    "ssh": ssh_commands,
    "pdsh": pdsh_commands,
    "openmpi": openmpi_commands,
    "mpich": mpich_commands,
    "slurm": slurm_commands,
}
