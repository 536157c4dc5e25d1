"""ds-launch's flags, the launch decision they lead to, and which variables reach the workers."""

from __future__ import annotations

from pathlib import Path

import pytest

import ds_strategy.launcher
from ds_strategy.launcher import cli, launch
from ds_strategy.launcher.environment import EnvError, exported_variables, user_variables
from ds_strategy.launcher.hostfile import HostfileError, Node

ROOT = Path(__file__).resolve().parents[2]


def test_console_script_points_at_main() -> None:
    # (tomllib is 3.11+, the project supports 3.10: read the one line.)
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("[", 1)[0]
    assert 'ds-launch = "ds_strategy.launcher:main"' in scripts.splitlines()
    assert ds_strategy.launcher.main is launch.main


def test_deepspeed_flags_and_dashed_aliases() -> None:
    args = cli.parse_args(
        [
            "--num_gpus",
            "2",
            "--num-nodes",
            "1",
            "-H",
            "hf",
            "-i",
            "a:0@b",
            "--master_addr",
            "10.0.0.1",
            "--master-port",
            "9901",
            "--launcher",
            "mpirun",
            "--launcher_args",
            "--mca btl ^openib",
            "--no_local_rank",
            "--module",
            "--enable_each_rank_log",
            "logs",
            "--max_restarts",
            "2",
            "--env",
            "A=1",
            "--env",
            "B",
            "train",
            "--deepspeed",
            "--deepspeed_config",
            "ds.json",
            "--num_gpus",
            "9",
        ]
    )
    assert args.num_procs == 2 and args.num_nodes == 1 and args.hostfile == "hf" and args.include == "a:0@b"
    assert (args.master_addr, args.master_port, args.launcher) == ("10.0.0.1", 9901, "openmpi")
    assert args.launcher_args == ("--mca", "btl", "^openib")
    assert args.no_local_rank and args.module and args.log_dir == "logs" and args.max_restarts == 2
    assert args.env == ("A=1", "B")
    # Everything after the script belongs to the script, even flags the launcher also has.
    assert args.user_script == "train"
    assert args.user_args == ("--deepspeed", "--deepspeed_config", "ds.json", "--num_gpus", "9")
    assert cli.parse_args(["--num_procs", "3", "--launcher", "srun", "x.py"]).launcher == "slurm"
    assert args.autotuning is None
    assert cli.parse_args(["--autotuning", "run", "x.py", "--autotuning", "tune"]).autotuning == "run"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_gpus", "0", "x.py"], "must be positive"),
        (["--master_port", "70000", "x.py"], "1..65535"),
        (["--include", "a", "--exclude", "b", "x.py"], "cannot be used together"),
        (["--node_rank", "1", "x.py"], "--node_rank 1 needs --num_nodes greater than it"),
        (["--node_rank", "2", "--num_nodes", "2", "x.py"], "needs --num_nodes greater"),
        (["--node_rank", "0", "--num_nodes", "2", "-H", "hf", "x.py"], "drop it with --hostfile"),
        (["--launcher", "mesos", "x.py"], "invalid choice"),
        (["--module", "--no_python", "x.py"], "cannot be used together"),
        (["--autotuning", "search", "x.py"], "invalid choice"),
        (["--autotuning", "tune", "--no_python", "x.py"], "drop --no_python"),
        (["--num_gpus", "2"], "required: user_script"),
    ],
)
def test_flag_errors_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _decide(argv: list[str], environ: dict[str, str] | None = None) -> launch.Decision:
    return launch.decide(cli.parse_args([*argv, "train.py"]), environ or {})


def test_decide_local_defaults() -> None:
    d = _decide(["--num_procs", "2"])
    assert (d.launcher, d.node_rank, d.num_nodes, d.master_addr) == ("torchrun", 0, 1, "127.0.0.1")
    assert d.plan.nodes == (Node("localhost", (0, 1)),)
    assert _decide(["--num_procs", "4", "--include", "localhost:1,3"]).plan.nodes == (Node("localhost", (1, 3)),)


def test_decide_one_node_of_several_started_by_hand() -> None:
    d = _decide(["--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.1.1.1", "--num_procs", "3"])
    assert (d.launcher, d.node_rank, d.num_nodes, d.master_addr) == ("torchrun", 1, 2, "10.1.1.1")
    assert d.plan.nodes == (Node("localhost", (0, 1, 2)),)
    with pytest.raises(HostfileError, match="start one ds-launch per node with --node_rank"):
        _decide(["--num_nodes", "2"])
    with pytest.raises(HostfileError, match="give --master_addr"):
        _decide(["--num_nodes", "2", "--node_rank", "0"])


def test_decide_hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    monkeypatch.setattr(launch, "_default_multi_host_launcher", lambda: "pdsh")
    d = _decide(["-H", str(hf)])
    assert (d.launcher, d.master_addr, d.plan.world_size) == ("pdsh", "worker-0", 4)
    d = _decide(["-H", str(hf), "--launcher", "slurm", "--num_nodes", "1", "--master_addr", "10.0.0.2"])
    assert (d.launcher, d.master_addr, d.plan.hosts) == ("slurm", "10.0.0.2", ["worker-0"])
    with pytest.raises(HostfileError, match="--launcher torchrun starts ranks on this machine only"):
        _decide(["-H", str(hf), "--launcher", "torchrun"])
    # A hostfile naming only this machine runs locally.
    hf.write_text("localhost slots=2\n")
    assert _decide(["-H", str(hf)]).launcher == "torchrun"


def test_decide_slurm_from_the_allocation() -> None:
    d = _decide(["--launcher", "srun", "--num_procs", "2"], {"SLURM_JOB_NODELIST": "gpu[07-08]"})
    assert d.plan.nodes == (Node("gpu07", (0, 1)), Node("gpu08", (0, 1)))
    assert d.master_addr == "gpu07" and d.slurm_nodelist
    # Outside an allocation srun picks the hosts: no --nodelist, ranks read MASTER_ADDR themselves.
    d = _decide(["--launcher", "srun", "--num_nodes", "3", "--num_procs", "2"])
    assert (d.plan.world_size, d.plan.num_nodes, d.slurm_nodelist, d.master_addr) == (6, 3, False, "")


def test_decide_remote_node_from_world_info() -> None:
    from ds_strategy.launcher.hostfile import WorldPlan

    plan = WorldPlan((Node("a", (0, 1)), Node("b", (2, 3))))
    d = _decide(["--world_info", plan.encode(), "--node_rank", "1", "--master_addr", "a"])
    assert (d.launcher, d.node_rank, d.num_nodes, d.plan.nodes) == ("torchrun", 1, 2, (Node("b", (2, 3)),))
    with pytest.raises(HostfileError, match="outside the plan's 2 nodes"):
        _decide(["--world_info", plan.encode(), "--node_rank", "5", "--master_addr", "a"])


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert launch.run(["-H", str(tmp_path / "missing"), "train.py"]) == 2
    assert "ds-launch: error: cannot read hostfile" in capsys.readouterr().err
    assert launch.run(["--launcher", "ssh", "train.py"]) == 2
    assert "needs --hostfile" in capsys.readouterr().err


def test_user_variables_env_file_then_flags(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("# forwarded\nNCCL_IB_DISABLE=1\nexport NCCL_P2P_DISABLE=1\nA=x=y\n")
    got = user_variables(["A=2", "HOME_VAR"], {"HOME_VAR": "h"}, tmp_path)
    assert got == {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "A": "2", "HOME_VAR": "h"}
    explicit = tmp_path / "other.env"
    explicit.write_text("B=3\n")
    assert user_variables([], {"DS_ENV_FILE": str(explicit)}, tmp_path) == {"B": "3"}


def test_env_errors(tmp_path: Path) -> None:
    bad = tmp_path / ".deepspeed_env"
    bad.write_text("OK=1\nnot a line\n")
    with pytest.raises(EnvError, match=r"\.deepspeed_env:2: expected 'NAME=VALUE'"):
        user_variables([], {}, tmp_path)
    with pytest.raises(EnvError, match="--env MISSING: the variable is not set here"):
        user_variables(["MISSING"], {}, tmp_path / "none")
    with pytest.raises(EnvError, match="'1A' is not a variable name"):
        user_variables(["1A=2"], {}, tmp_path / "none")
    with pytest.raises(EnvError, match="DS_ENV_FILE='/nope' does not name a file"):
        user_variables([], {"DS_ENV_FILE": "/nope"}, tmp_path)


def test_exported_variables_by_prefix_then_user() -> None:
    environ = {
        "NCCL_IB_DISABLE": "1",
        "PYTHONPATH": "/src",
        "HOME": "/root",
        "TORCH_EXTENSIONS_DIR": "/c",
        "SECRET": "s",
        "OMP_NUM_THREADS": "4",
    }
    got = exported_variables({"A": "1", "NCCL_IB_DISABLE": "0"}, environ)
    assert got == {
        "NCCL_IB_DISABLE": "0",
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/src",
        "TORCH_EXTENSIONS_DIR": "/c",
        "A": "1",
    }
