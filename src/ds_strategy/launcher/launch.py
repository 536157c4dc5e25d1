"""``ds-launch``: from the command line to a plan, then to torch's elastic agent or a multi-host runner."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ds_strategy.scheduler_env import expand_nodelist

from .cli import LaunchArgs, parse_args
from .environment import EnvError, exported_variables, user_variables
from .hostfile import HostfileError, Node, WorldPlan, parse_hostfile, resolve_plan
from .programs import EXIT_MISSING_PROGRAM, MissingProgramError, require_launcher_programs, require_script_program

# What every rank runs under ``--autotuning``: named, not imported (the autotuner sits above the launcher).
AUTOTUNING_MODULE = "ds_strategy.autotuning.script"


def with_autotuning(args: LaunchArgs) -> LaunchArgs:
    """``--autotuning MODE script.py args``: every rank runs ``python -u -m ds_strategy.autotuning.script --mode
    MODE [--module] script.py args`` instead, which runs the script with the autotuner waiting inside its
    ``initialize()`` call (docs/autotuning.md, "From the command line"). The same for every launcher: the
    local agent, the node launchers of ssh / pdsh and the bootstrap of mpirun / srun run a module."""
    if args.autotuning is None:
        return args
    flags = ("--mode", args.autotuning, *(("--module",) if args.module else ()))
    return replace(
        args, user_script=AUTOTUNING_MODULE, user_args=(*flags, args.user_script, *args.user_args), module=True
    )


@dataclass(frozen=True)
class Decision:
    """What to start: the plan, the launcher, and (torchrun) which node of the plan this process is."""

    plan: WorldPlan
    launcher: str
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = ""
    slurm_nodelist: bool = True


def _local_device_count() -> int:
    import torch

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def _default_multi_host_launcher() -> str:
    import shutil

    return "pdsh" if shutil.which("pdsh") else "ssh"


def decide(args: LaunchArgs, environ: Mapping[str, str]) -> Decision:
    """Resolve resources and launcher from the flags (raises HostfileError with a message for the user)."""
    if args.world_info is not None:
        # This is one node of a multi-host launch: ssh / pdsh started us with the plan and our node rank.
        plan = WorldPlan.decode(args.world_info)
        if not 0 <= args.node_rank < plan.num_nodes:
            raise HostfileError(f"--node_rank {args.node_rank} is outside the plan's {plan.num_nodes} nodes")
        if not args.master_addr:
            raise HostfileError("--world_info needs --master_addr")
        node = plan.nodes[args.node_rank]
        return Decision(WorldPlan((node,)), "torchrun", args.node_rank, plan.num_nodes, args.master_addr)

    launcher = args.launcher
    if args.hostfile:
        pool = parse_hostfile(args.hostfile)
    elif launcher == "slurm" and (environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")):
        # Inside an allocation: its hosts, each running --num_procs ranks (default 1).
        hosts = expand_nodelist(environ.get("SLURM_JOB_NODELIST") or environ["SLURM_NODELIST"])
        pool = dict.fromkeys(hosts, max(args.num_procs, 1))
    elif launcher == "slurm":
        # Outside an allocation srun makes one; the hosts are unknown until then, so no --nodelist, and
        # every rank reads MASTER_ADDR from the SLURM_JOB_NODELIST srun gives it (bootstrap.py).
        nodes = tuple(
            Node(f"<slurm node {i}>", tuple(range(max(args.num_procs, 1)))) for i in range(max(args.num_nodes, 1))
        )
        return Decision(WorldPlan(nodes), "slurm", master_addr=args.master_addr, slurm_nodelist=False)
    else:
        if launcher in ("ssh", "pdsh"):
            raise HostfileError(f"--launcher {launcher} needs --hostfile to know the hosts")
        pool = {"localhost": args.num_procs if args.num_procs > 0 else _local_device_count()}
        if args.num_nodes > 1 and (launcher in (None, "torchrun")):
            # One ds-launch per node, started by the user (or a scheduler) like torchrun --nnodes.
            if args.node_rank < 0:
                raise HostfileError(
                    f"--num_nodes {args.num_nodes} without --hostfile: start one ds-launch per node with "
                    "--node_rank R and node 0's --master_addr, or list the hosts in a --hostfile"
                )
            if not args.master_addr:
                raise HostfileError(f"--num_nodes {args.num_nodes}: give --master_addr (node 0's address)")
            plan = resolve_plan(pool, include=args.include, exclude=args.exclude)
            return Decision(plan, "torchrun", args.node_rank, args.num_nodes, args.master_addr)
    procs = args.num_procs if args.hostfile or launcher == "slurm" else -1
    plan = resolve_plan(pool, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes, num_procs=procs)
    if launcher is None:
        launcher = "torchrun" if plan.is_local() else _default_multi_host_launcher()
    if launcher == "torchrun":
        if not plan.is_local():
            raise HostfileError(
                f"--launcher torchrun starts ranks on this machine only, but the plan names {plan.hosts}: use "
                "--launcher ssh/pdsh/openmpi/mpich/slurm, or run ds-launch on each node with --node_rank"
            )
        return Decision(plan, "torchrun", 0, 1, args.master_addr or "127.0.0.1")
    return Decision(plan, launcher, master_addr=args.master_addr or plan.nodes[0].host)


def _run_local(args: LaunchArgs, decision: Decision, user_vars: Mapping[str, str]) -> int:
    from .local import LocalJob, run_local, worker_command

    os.environ.update(user_vars)
    if args.no_python:
        require_script_program(args.user_script, os.environ)
    job = LocalJob(
        node=decision.plan.nodes[0],
        num_nodes=decision.num_nodes,
        node_rank=decision.node_rank,
        master_addr=decision.master_addr,
        master_port=args.master_port,
        command=worker_command(
            args.user_script,
            args.user_args,
            module=args.module,
            no_python=args.no_python,
            no_local_rank=args.no_local_rank,
        ),
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        rdzv_timeout=args.rdzv_timeout,
    )
    return run_local(job)


def _run_multi_host(args: LaunchArgs, decision: Decision, user_vars: Mapping[str, str]) -> int:
    from .runners import RUNNERS, Command, RemoteJob, slurm_commands
    from .supervise import supervise

    job = RemoteJob(
        plan=decision.plan,
        master_addr=decision.master_addr,
        master_port=args.master_port,
        user_script=args.user_script,
        user_args=args.user_args,
        exports=exported_variables(user_vars),
        python=sys.executable,
        cwd=os.getcwd(),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        log_dir=args.log_dir,
        max_restarts=args.max_restarts,
        launcher_args=args.launcher_args,
        ssh_port=args.ssh_port,
    )
    commands: list[Command] = (
        slurm_commands(job, nodelist=decision.slurm_nodelist)
        if decision.launcher == "slurm"
        else RUNNERS[decision.launcher](job)
    )
    names = [f"node {i} ({host})" for i, host in enumerate(decision.plan.hosts)]
    if decision.launcher != "ssh":
        names = [decision.launcher]  # one pdsh / mpirun / srun process for the whole job
    try:
        require_launcher_programs(decision.launcher, commands, os.environ)  # before anything is started
    except MissingProgramError as exc:
        if not args.dry_run:
            raise
        # A dry run may be prepared on another machine than the one that launches: warn, still show the commands.
        print(f"ds-launch: warning: {exc}", file=sys.stderr)
    for cmd in commands:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
        print(f"ds-launch: {env + ' ' if env else ''}{shlex.join(cmd.argv)}", file=sys.stderr)
    if args.dry_run:
        return 0
    return supervise(commands, names=names)


def run(argv: Sequence[str] | None = None) -> int:
    """The whole launcher; returns the exit status (0, the failed rank's code, 128+signal, 2 for usage, 127 for
    a program such as ssh / mpirun / srun that is not found)."""
    args = with_autotuning(parse_args(argv))
    try:
        user_vars = user_variables(args.env, os.environ, Path.cwd())
        decision = decide(args, os.environ)
        if decision.launcher == "torchrun":
            if args.dry_run:
                print(f"ds-launch: would run {decision.plan} as node {decision.node_rank} of {decision.num_nodes}")
                return 0
            return _run_local(args, decision, user_vars)
        return _run_multi_host(args, decision, user_vars)
    except (HostfileError, EnvError) as exc:
        print(f"ds-launch: error: {exc}", file=sys.stderr)
        return 2
    except MissingProgramError as exc:
        print(f"ds-launch: error: {exc}", file=sys.stderr)
        return EXIT_MISSING_PROGRAM
    except KeyboardInterrupt:
        # Ctrl-C before any worker started (during rendezvous): nothing to stop.
        print("ds-launch: interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(argv))
