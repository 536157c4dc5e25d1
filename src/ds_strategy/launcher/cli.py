"""``ds-launch`` command line: DeepSpeed's launcher flags, parsed into a frozen ``LaunchArgs``.

    ds-launch [--num_gpus N] [--num_nodes N] [--hostfile F] [--include/--exclude SPEC] [--master_addr A]
              [--master_port P] [--node_rank R] [--launcher L] [--no_local_rank] [--module] [--log_dir D]
              [--max_restarts N] [--env KEY=VALUE] [--autotuning tune|run] script.py [script args...]

Flags take DeepSpeed's underscore spelling; the dashed spelling (``--num-gpus``) works too.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500
# ssh / pdsh run one ds-launch per node (torchrun there); the MPI and SLURM launchers start every rank
# themselves and the workers read their rank from the scheduler's variables (see bootstrap.py).
LAUNCHERS = ("torchrun", "ssh", "pdsh", "openmpi", "mpich", "slurm")
LAUNCHER_ALIASES = {"mpirun": "openmpi", "srun": "slurm", "local": "torchrun"}


@dataclass(frozen=True)
class LaunchArgs:
    user_script: str
    user_args: tuple[str, ...]
    num_procs: int = -1
    num_nodes: int = -1
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    master_addr: str = ""
    master_port: int = DEFAULT_MASTER_PORT
    node_rank: int = -1
    launcher: str | None = None
    launcher_args: tuple[str, ...] = ()
    no_local_rank: bool = False
    module: bool = False
    no_python: bool = False
    log_dir: str | None = None
    max_restarts: int = 0
    env: tuple[str, ...] = ()
    ssh_port: int | None = None
    world_info: str | None = None
    rdzv_timeout: int = 900
    dry_run: bool = False
    autotuning: str | None = None  # "tune" or "run": each rank runs the script under the autotuner (launch.py)


def _flag(*names: str) -> list[str]:
    """Each underscore flag also answers to its dashed spelling."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if name.startswith("--") and "_" in name:
            out.append(name.replace("_", "-"))
    return out


def build_parser(prog: str = "ds-launch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Launch a ds_strategy / DeepSpeed-style training script on one or several machines.",
        allow_abbrev=False,
    )
    res = p.add_argument_group("resources")
    res.add_argument(
        *_flag("--num_gpus", "--num_procs", "--num_accelerators"),
        dest="num_procs",
        metavar="N",
        type=int,
        default=-1,
        help="ranks per node (default: the visible GPUs, else 1; with a hostfile: every slot)",
    )
    res.add_argument(*_flag("--num_nodes"), type=int, default=-1, help="nodes to use (default: all listed)")
    res.add_argument(
        "-H", *_flag("--hostfile"), default=None, help="hostfile with lines 'HOST slots=N' (comments with #)"
    )
    res.add_argument("-i", "--include", default="", help="hosts/slots to use, e.g. 'worker-0:0,1@worker-1'")
    res.add_argument("-e", "--exclude", default="", help="hosts/slots to leave out, same syntax as --include")
    net = p.add_argument_group("rendezvous")
    net.add_argument(*_flag("--master_addr"), default="", help="rank 0's address (default: first host)")
    net.add_argument(*_flag("--master_port"), type=int, default=DEFAULT_MASTER_PORT, help="rank 0's TCP port")
    net.add_argument(
        *_flag("--node_rank"),
        type=int,
        default=-1,
        help="this node's rank when starting one ds-launch per node yourself (with --num_nodes, no hostfile)",
    )
    net.add_argument(*_flag("--rdzv_timeout"), type=int, default=900, help="seconds to wait for every node")
    how = p.add_argument_group("how to start workers")
    how.add_argument(
        "--launcher",
        type=str.lower,
        choices=LAUNCHERS + tuple(LAUNCHER_ALIASES),
        default=None,
        help="torchrun (default for one node), ssh or pdsh (default for several hosts), openmpi/mpirun, "
        "mpich, slurm/srun",
    )
    how.add_argument(
        *_flag("--launcher_args"), default="", help="extra arguments for ssh / pdsh / mpirun / srun (one quoted string)"
    )
    how.add_argument(*_flag("--ssh_port"), type=int, default=None, help="ssh port for the ssh and pdsh launchers")
    how.add_argument(*_flag("--no_local_rank"), action="store_true", help="do not append --local_rank=N")
    how.add_argument("-m", "--module", action="store_true", help="run the script as 'python -m MODULE'")
    how.add_argument(*_flag("--no_python"), action="store_true", help="run the script as an executable")
    how.add_argument(
        *_flag("--log_dir", "--enable_each_rank_log"),
        dest="log_dir",
        metavar="DIR",
        default=None,
        help="directory for per-rank log files rank<R>.stdout.log / rank<R>.stderr.log (still shown on console)",
    )
    how.add_argument(
        *_flag("--max_restarts"), type=int, default=0, help="restart all local workers this often on a failure"
    )
    how.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="variable for every worker (repeatable); KEY alone forwards this shell's value",
    )
    how.add_argument(*_flag("--dry_run"), action="store_true", help="print the multi-host command lines and exit")
    how.add_argument(
        "--autotuning",
        choices=("tune", "run"),
        default=None,
        help="tune: find the fastest ZeRO configuration inside the script's initialize() call, write it and stop; "
        "run: find it, then train with it (the config's autotuning block, docs/autotuning.md)",
    )
    p.add_argument(*_flag("--world_info"), default=None, help=argparse.SUPPRESS)
    p.add_argument("user_script", help="training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments for the training script")
    return p


def parse_args(argv: Sequence[str] | None = None, *, prog: str = "ds-launch") -> LaunchArgs:
    """Parse and check the flags that can be checked alone; exits with status 2 and a message on error."""
    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    launcher = LAUNCHER_ALIASES.get(ns.launcher, ns.launcher)
    if ns.num_procs == 0 or ns.num_procs < -1:
        parser.error(f"--num_gpus/--num_procs must be positive (or -1 for auto), got {ns.num_procs}")
    if ns.num_nodes == 0 or ns.num_nodes < -1:
        parser.error(f"--num_nodes must be positive (or -1 for all), got {ns.num_nodes}")
    if not 0 < ns.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {ns.master_port}")
    if ns.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0, got {ns.max_restarts}")
    if ns.include and ns.exclude:
        parser.error("--include and --exclude cannot be used together: pick one")
    if ns.module and ns.no_python:
        parser.error("--module and --no_python cannot be used together")
    if ns.autotuning and ns.no_python:
        parser.error(
            "--autotuning runs the script in Python (the tune happens inside its initialize()); drop --no_python"
        )
    if ns.node_rank >= 0:
        if ns.hostfile and ns.world_info is None:
            parser.error("--node_rank is for starting one ds-launch per node yourself; drop it with --hostfile")
        if ns.world_info is None and (ns.num_nodes < 1 or ns.node_rank >= ns.num_nodes):
            parser.error(f"--node_rank {ns.node_rank} needs --num_nodes greater than it (got {ns.num_nodes})")
    elif ns.node_rank < -1:
        parser.error(f"--node_rank must be >= 0, got {ns.node_rank}")
    try:
        launcher_args = tuple(shlex.split(ns.launcher_args))
    except ValueError as exc:
        parser.error(f"--launcher_args {ns.launcher_args!r}: {exc}")
    # Every flag's dest is the LaunchArgs field of the same name (a flag without one fails here, in any test
    # that parses); the alias-resolved launcher, the split launcher_args and tuples for the lists go in.
    normalised = {
        "launcher": launcher,
        "launcher_args": launcher_args,
        "user_args": tuple(ns.user_args),
        "env": tuple(ns.env),
    }
    return LaunchArgs(**(vars(ns) | normalised))
