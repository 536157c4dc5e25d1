"""Worker-side start for ranks that mpirun or srun started: scheduler variables -> torch's, then the script.

    mpirun ... python -u -m ds_strategy.launcher.bootstrap [--no_local_rank] [--module] script.py args

OpenMPI (OMPI_COMM_WORLD_*), MPICH / Intel MPI (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS)
and SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE, SLURM_NODEID) are translated
into RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK; MASTER_ADDR comes from the launcher
(``-x`` / the environment) or, under SLURM, the first host of SLURM_JOB_NODELIST. The script then runs in
this process (``runpy``), so the rank the scheduler signals is the rank that trains.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Mapping, Sequence

from .cli import DEFAULT_MASTER_PORT
from .slurm import expand_nodelist, expand_tasks_per_node


class SchedulerEnvError(RuntimeError):
    """The process was not started by a scheduler we know, or its variables are incomplete."""


def _need(environ: Mapping[str, str], name: str, scheme: str) -> str:
    if name not in environ:
        raise SchedulerEnvError(f"{scheme} started this process but {name} is not set")
    return environ[name]


def rank_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's env:// variables derived from whichever scheduler started this process."""
    if "OMPI_COMM_WORLD_RANK" in environ:
        scheme = "OpenMPI"
        out = {
            "RANK": environ["OMPI_COMM_WORLD_RANK"],
            "WORLD_SIZE": _need(environ, "OMPI_COMM_WORLD_SIZE", scheme),
            "LOCAL_RANK": _need(environ, "OMPI_COMM_WORLD_LOCAL_RANK", scheme),
            "LOCAL_SIZE": _need(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", scheme),
        }
    elif "PMI_RANK" in environ:
        scheme = "MPICH / Intel MPI"
        out = {
            "RANK": environ["PMI_RANK"],
            "WORLD_SIZE": _need(environ, "PMI_SIZE", scheme),
            "LOCAL_RANK": _need(environ, "MPI_LOCALRANKID", scheme),
            "LOCAL_SIZE": _need(environ, "MPI_LOCALNRANKS", scheme),
        }
    elif "SLURM_PROCID" in environ:
        scheme = "SLURM"
        counts = expand_tasks_per_node(_need(environ, "SLURM_TASKS_PER_NODE", scheme))
        node_id = int(_need(environ, "SLURM_NODEID", scheme))
        if node_id >= len(counts):
            raise SchedulerEnvError(f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE lists {len(counts)} nodes")
        out = {
            "RANK": environ["SLURM_PROCID"],
            "WORLD_SIZE": _need(environ, "SLURM_NTASKS", scheme),
            "LOCAL_RANK": _need(environ, "SLURM_LOCALID", scheme),
            "LOCAL_SIZE": str(counts[node_id]),
            "GROUP_RANK": str(node_id),
        }
    elif "RANK" in environ and "WORLD_SIZE" in environ:
        return {}  # torchrun or a user already set them
    else:
        raise SchedulerEnvError(
            "no rank variables found: start this module with mpirun (OpenMPI / MPICH) or srun, "
            "or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
        )
    out["LOCAL_WORLD_SIZE"] = out["LOCAL_SIZE"]
    # The node index (torchelastic's GROUP_RANK; Lightning reads it when LOCAL_RANK is set). MPI has no such
    # variable; our mpirun lines fill hosts one after the other, so it is RANK // LOCAL_SIZE.
    out.setdefault("GROUP_RANK", str(int(out["RANK"]) // max(int(out["LOCAL_SIZE"]), 1)))
    if not environ.get("MASTER_ADDR"):
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise SchedulerEnvError(
                f"{scheme} gave this process rank {out['RANK']} but MASTER_ADDR is not set: pass "
                "--master_addr to ds-launch or export MASTER_ADDR to every rank"
            )
        out["MASTER_ADDR"] = expand_nodelist(nodelist)[0]
    out.setdefault("MASTER_PORT", environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT)))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_strategy.launcher.bootstrap", allow_abbrev=False)
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--module", action="store_true")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        os.environ.update(rank_variables(os.environ))
    except (SchedulerEnvError, ValueError) as exc:
        sys.exit(f"ds-launch bootstrap: {exc}")
    args = list(ns.user_args)
    if not ns.no_local_rank:
        args.append(f"--local_rank={os.environ['LOCAL_RANK']}")
    if ns.module:
        sys.argv = [ns.user_script, *args]
        runpy.run_module(ns.user_script, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [ns.user_script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.user_script)))
        runpy.run_path(ns.user_script, run_name="__main__")


if __name__ == "__main__":
    main()
