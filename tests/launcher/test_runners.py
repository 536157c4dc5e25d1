"""Multi-host command lines (no cluster here: the argv each runner builds is compared whole), the
worker-side bootstrap's reading of MPI / SLURM variables, SLURM host lists, and the supervisor."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pytest

from ds_strategy.launcher import launch
from ds_strategy.launcher.bootstrap import SchedulerEnvError, rank_variables
from ds_strategy.launcher.hostfile import HostfileError, Node, WorldPlan
from ds_strategy.launcher.runners import (
    Command,
    RemoteJob,
    mpich_commands,
    openmpi_commands,
    pdsh_commands,
    slurm_commands,
    ssh_commands,
)
from ds_strategy.launcher.supervise import supervise
from ds_strategy.scheduler_env import expand_nodelist, expand_tasks_per_node
from tests.launcher.common import alive

PLAN = WorldPlan((Node("w0", (0, 1)), Node("w1", (0, 1))))
BOOT = ["py", "-u", "-m", "ds_strategy.launcher.bootstrap", "train.py", "--deepspeed_config", "ds config.json"]


def _job(plan: WorldPlan = PLAN, **kw: object) -> RemoteJob:
    base: dict[str, object] = dict(
        plan=plan,
        master_addr="w0",
        master_port=29500,
        user_script="train.py",
        user_args=("--deepspeed_config", "ds config.json"),
        exports={"NCCL_IB_DISABLE": "1", "MSG": "a b;c"},
        python="py",
        cwd="/work dir",
    )
    base.update(kw)
    return RemoteJob(**base)  # type: ignore[arg-type]


def _node_launcher(rank: str, plan: WorldPlan = PLAN, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "py",
        "-u",
        "-m",
        "ds_strategy.launcher",
        "--launcher=torchrun",
        f"--world_info={plan.encode()}",
        f"--node_rank={rank}",
        f"--num_nodes={plan.num_nodes}",
        "--master_addr=w0",
        "--master_port=29500",
        "--max_restarts=0",
        *extra,
        "train.py",
        "--deepspeed_config",
        "ds config.json",
    ]


def test_ssh_one_command_per_host() -> None:
    cmds = ssh_commands(_job(ssh_port=2222, log_dir="/logs", no_local_rank=True))
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        assert cmd.argv[:7] == ("ssh", "-tt", "-o", "BatchMode=yes", "-p", "2222", f"w{rank}")
        remote = cmd.argv[7]
        # The remote shell line: same directory, exports quoted, then this node's ds-launch.
        cd, rest = remote.split(" && ", 1)
        assert shlex.split(cd) == ["cd", "/work dir"]
        assert shlex.split(rest) == [
            "export",
            "NCCL_IB_DISABLE=1;",
            "export",
            "MSG=a b;c;",
            *_node_launcher(str(rank), extra=("--log_dir=/logs", "--no_local_rank")),
        ]


def test_pdsh_substitutes_node_rank() -> None:
    (cmd,) = pdsh_commands(_job(launcher_args=("-R", "ssh")))
    assert cmd.argv[:8] == ("pdsh", "-S", "-f", "1024", "-w", "w0,w1", "-R", "ssh")
    assert shlex.split(cmd.argv[8].split(" && ", 1)[1])[4:] == _node_launcher("%n")
    assert cmd.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-tt"}
    (cmd,) = pdsh_commands(_job(ssh_port=2200))
    assert cmd.env["PDSH_SSH_ARGS_APPEND"] == "-tt -p 2200"


def test_openmpi_command() -> None:
    (cmd,) = openmpi_commands(_job(plan=WorldPlan((Node("w0", (0, 1, 2)), Node("w1", (0,)))), module=True))
    assert list(cmd.argv) == [
        "mpirun",
        "-n",
        "4",
        "-H",
        "w0:3,w1:1",
        "--wdir",
        "/work dir",
        "-x",
        "MASTER_ADDR=w0",
        "-x",
        "MASTER_PORT=29500",
        "-x",
        "NCCL_IB_DISABLE=1",
        "-x",
        "MSG=a b;c",
        "py",
        "-u",
        "-m",
        "ds_strategy.launcher.bootstrap",
        "--module",
        "train.py",
        "--deepspeed_config",
        "ds config.json",
    ]


def test_mpich_command_and_uniform_ranks() -> None:
    (cmd,) = mpich_commands(_job(launcher_args=("-bind-to", "core")))
    assert list(cmd.argv) == [
        "mpirun",
        "-n",
        "4",
        "-ppn",
        "2",
        "-hosts",
        "w0,w1",
        "-genv",
        "MASTER_ADDR",
        "w0",
        "-genv",
        "MASTER_PORT",
        "29500",
        "-genv",
        "NCCL_IB_DISABLE",
        "1",
        "-genv",
        "MSG",
        "a b;c",
        "-bind-to",
        "core",
        *BOOT,
    ]
    with pytest.raises(HostfileError, match="same number of ranks on every host; got w0=2, w1=1"):
        mpich_commands(_job(plan=WorldPlan((Node("w0", (0, 1)), Node("w1", (0,))))))


def test_slurm_command() -> None:
    (cmd,) = slurm_commands(_job())
    assert list(cmd.argv) == [
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--nodelist",
        "w0,w1",
        "--chdir=/work dir",
        *BOOT,
    ]
    assert cmd.env == {"MASTER_ADDR": "w0", "MASTER_PORT": "29500", "NCCL_IB_DISABLE": "1", "MSG": "a b;c"}
    (cmd,) = slurm_commands(_job(master_addr=""), nodelist=False)
    assert "--nodelist" not in cmd.argv and "MASTER_ADDR" not in cmd.env


def test_scheduler_launchers_refuse_device_picks_and_no_python() -> None:
    picked = WorldPlan((Node("w0", (1, 3)),))
    for build in (openmpi_commands, mpich_commands, slurm_commands):
        with pytest.raises(HostfileError, match=r"cannot pick devices \[1, 3\] on 'w0'.*ssh or pdsh"):
            build(_job(plan=picked))
        with pytest.raises(HostfileError, match="--no_python cannot be used with mpirun / srun"):
            build(_job(no_python=True))


def test_dry_run_prints_the_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("w0 slots=2\nw1 slots=2\n")
    assert launch.run(["-H", str(hf), "--launcher", "openmpi", "--dry_run", "--env", "X=1", "t.py", "--a"]) == 0
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("ds-launch: mpirun -n 4 -H w0:2,w1:2 ")
    assert "-x X=1" in line and line.endswith("-m ds_strategy.launcher.bootstrap t.py --a")


OMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "MASTER_ADDR": "w0",
    "MASTER_PORT": "1234",
}


def test_bootstrap_reads_openmpi_mpich_and_slurm() -> None:
    assert rank_variables(OMPI) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_PORT": "1234",
    }
    mpich = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h"}
    assert rank_variables(mpich) == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_PORT": "29500",
    }
    slurm = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "5",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x2),1",
        "SLURM_JOB_NODELIST": "gpu[07-09]",
    }
    assert rank_variables(slurm) == {
        "RANK": "3",
        "WORLD_SIZE": "5",
        "LOCAL_RANK": "0",
        "LOCAL_SIZE": "1",
        "GROUP_RANK": "2",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29500",
    }
    assert rank_variables({**slurm, "MASTER_ADDR": ""})["MASTER_ADDR"] == "gpu07"  # empty counts as unset
    assert rank_variables({"RANK": "0", "WORLD_SIZE": "1"}) == {}  # torchrun already set them


def test_bootstrap_errors_name_what_is_missing() -> None:
    with pytest.raises(SchedulerEnvError, match="no rank variables found"):
        rank_variables({})
    with pytest.raises(SchedulerEnvError, match="OpenMPI started this process but OMPI_COMM_WORLD_LOCAL_SIZE"):
        rank_variables({k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"})
    with pytest.raises(SchedulerEnvError, match="rank 5 but MASTER_ADDR is not set"):
        rank_variables({k: v for k, v in OMPI.items() if k != "MASTER_ADDR"})


def test_slurm_host_lists() -> None:
    assert expand_nodelist("node[01-03,7],gpu-a") == ["node01", "node02", "node03", "node7", "gpu-a"]
    assert expand_nodelist("a[1-2]-ib[0-1]") == ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1"]
    assert expand_nodelist("single") == ["single"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_nodelist("node[1-2")
    with pytest.raises(ValueError, match="'x' is not N or N-M"):
        expand_nodelist("node[x]")
    with pytest.raises(ValueError, match="'2x' is not N or N\\(xM\\)"):
        expand_tasks_per_node("2x")


def test_supervisor_stops_the_rest_when_one_fails(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    waiter = Command(
        (sys.executable, "-c", f"import os,time; open({str(pid_file)!r},'w').write(str(os.getpid())); time.sleep(60)")
    )
    failer = Command((sys.executable, "-c", "import time,sys; time.sleep(1); sys.exit(4)"))
    start = time.monotonic()
    assert supervise([waiter, failer], names=["node 0", "node 1"]) == 4
    assert time.monotonic() - start < 15
    assert not alive(int(pid_file.read_text()))
    ok = Command((sys.executable, "-c", "pass"))
    assert supervise([ok, ok], names=["a", "b"]) == 0
