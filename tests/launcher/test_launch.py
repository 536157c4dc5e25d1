"""ds-launch end to end on this machine: ZeRO-2 training on 2 local ranks and on two "nodes" meeting on
loopback, the mpirun path through bootstrap, a failing rank, restarts, and SIGTERM / SIGINT cleanup.

Every process runs under a timeout (subprocess ``timeout=``, or a deadline and a kill in ``finally``),
so a broken launcher fails these tests instead of hanging them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launcher.common import LAUNCH, SCRIPTS, alive, env, free_port, wait_files, wait_gone

TRAIN = str(SCRIPTS / "train_zero.py")
WORKER = str(SCRIPTS / "worker.py")
TIMEOUT = 120


def _reference(world: int) -> list[torch.Tensor]:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import train_zero
    finally:
        sys.path.remove(str(SCRIPTS))
    return train_zero.reference_weights(world)


def _check_trained(out: Path, world: int) -> list[dict[str, object]]:
    """Every rank ended with the same weights, equal to single-process SGD on the same global batches."""
    weights = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    for r in range(1, world):
        for a, b in zip(weights[0], weights[r], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"rank {r}'s weights differ from rank 0's")
    for got, want in zip(weights[0], _reference(world), strict=True):
        # fp32, 4 SGD steps; the only difference is the order of the gradient all-reduce sum.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_two_local_ranks_train_zero2(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        *LAUNCH,
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "--log_dir",
        str(tmp_path / "logs"),
        "--env",
        "DS_TEST_USER_VAR=from --env",
        TRAIN,
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env(NCCL_P2P_DISABLE="1"), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    records = _check_trained(tmp_path, 2)
    for rank, rec in enumerate(records):
        assert rec["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        assert rec["local_rank_arg"] == rank and rec["argv"][-1] == f"--local_rank={rank}"
        assert rec["forwarded"] == {"NCCL_P2P_DISABLE": "1", "DS_TEST_USER_VAR": "from --env"}
        # Per-rank log files, and the console copy prefixed with the rank.
        assert (tmp_path / "logs" / f"rank{rank}.stdout.log").exists()
        assert (tmp_path / "logs" / f"rank{rank}.stderr.log").exists()


@pytest.mark.slow
def test_two_nodes_on_loopback_train_together(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                *LAUNCH,
                "--num_nodes",
                "2",
                "--node_rank",
                str(node),
                "--num_procs",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "--no_local_rank",
                TRAIN,
                "--out",
                str(tmp_path),
            ],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for node, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, f"node {node}: {err}"
    records = _check_trained(tmp_path, 2)
    for rank, rec in enumerate(records):
        env_ = rec["env"]
        assert isinstance(env_, dict)
        assert (env_["RANK"], env_["LOCAL_RANK"], env_["WORLD_SIZE"], env_["LOCAL_SIZE"]) == (str(rank), "0", "2", "1")
        assert rec["local_rank_arg"] is None  # --no_local_rank


@pytest.mark.slow
def test_mpirun_path_bootstrap_trains_with_openmpi_variables(tmp_path: Path) -> None:
    """What mpirun starts on each host: bootstrap turns OMPI_COMM_WORLD_* into torch's variables."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-u", "-m", "ds_strategy.launcher.bootstrap", TRAIN, "--out", str(tmp_path)],
            env=env(
                OMPI_COMM_WORLD_RANK=str(r),
                OMPI_COMM_WORLD_SIZE="2",
                OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                OMPI_COMM_WORLD_LOCAL_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    try:
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for r, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, f"rank {r}: {err} (files written: {sorted(f.name for f in tmp_path.iterdir())})"
    for rank, rec in enumerate(_check_trained(tmp_path, 2)):
        assert rec["local_rank_arg"] == rank
        assert rec["env"]["LOCAL_SIZE"] == "2" and rec["env"]["WORLD_SIZE"] == "2"  # type: ignore[index]


def test_failing_rank_ends_the_job_with_its_code_and_log(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [
            *LAUNCH,
            "--num_procs",
            "2",
            "--master_port",
            str(free_port()),
            WORKER,
            "--mode",
            "fail",
            "--code",
            "7",
            "--dir",
            str(tmp_path),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 7, proc.stderr
    assert "rank 1 (local rank 1" in proc.stderr and "exited with code 7" in proc.stderr
    # The failed rank's last log lines are repeated in the launcher's message.
    tail = proc.stderr.split("exited with code 7", 1)[1]
    assert "last" in tail and "marker-7f3a" in tail
    # Rank 0 would sleep 120 s: the launcher stopped it instead (promptly, and it is gone).
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after rank 1 failed"
    assert not wait_gone([int((tmp_path / "rank0.pids").read_text())], timeout=5)


def test_max_restarts_restarts_the_workers(tmp_path: Path) -> None:
    cmd = [
        *LAUNCH,
        "--num_procs",
        "2",
        "--master_port",
        str(free_port()),
        "--max_restarts",
        "1",
        WORKER,
        "--mode",
        "fail_once",
        "--code",
        "5",
        "--dir",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.attempt1", "rank1.attempt1"]
    assert "exited with code 5" not in proc.stderr  # the restart succeeded: no failure was reported


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_every_worker_and_grandchild(tmp_path: Path, sig: signal.Signals) -> None:
    launcher = subprocess.Popen(
        [
            *LAUNCH,
            "--num_procs",
            "2",
            "--master_port",
            str(free_port()),
            WORKER,
            "--mode",
            "hang",
            "--dir",
            str(tmp_path),
        ],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        pid_files = [tmp_path / "rank0.pids", tmp_path / "rank1.pids"]
        assert wait_files(pid_files, timeout=60), "the workers never started"
        pids = [int(x) for f in pid_files for x in f.read_text().split()]
        assert all(alive(p) for p in pids)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + sig, err
        assert f"received {sig.name}" in err
        # Workers and the processes they started: none left (zombies count as gone).
        assert wait_gone(pids, timeout=5) == [], f"left running after {sig.name}: {pids}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


FAKE_SSH = """#!/bin/sh
# ssh stand-in: skip the options and the host, run the remote command line here.
for last; do :; done
exec sh -c "$last"
"""
FAKE_PDSH = """#!/bin/sh
# pdsh stand-in: run the command once per host of -w, with %n replaced by the host's position.
while [ $# -gt 1 ]; do
  case "$1" in -w) hosts="$2"; shift 2;; -f) shift 2;; *) shift;; esac
done
n=0; pids=""
for h in $(echo "$hosts" | tr , ' '); do
  sh -c "$(printf '%s' "$1" | sed "s/%n/$n/g")" & pids="$pids $!"; n=$((n+1))
done
rc=0; for p in $pids; do wait $p || rc=$?; done; exit $rc
"""


def _fake_remote_shells(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("pdsh", FAKE_PDSH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_multi_host_command_lines_run_end_to_end(tmp_path: Path, launcher: str) -> None:
    """A hostfile of two "hosts" through ``--launcher ssh|pdsh``, with stand-ins for ssh / pdsh that run the
    remote command here: the quoting, the exported variables, --world_info and %n all have to work."""
    bin_dir = _fake_remote_shells(tmp_path)
    (tmp_path / "hostfile").write_text("node-a slots=2\nnode-b slots=1\n")
    out = tmp_path / "out dir"
    out.mkdir()
    port = free_port()
    proc = subprocess.run(
        [
            *LAUNCH,
            "-H",
            str(tmp_path / "hostfile"),
            "--launcher",
            launcher,
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "--env",
            "DS_TEST_USER_VAR=two words; $HOME",
            WORKER,
            "--mode",
            "record",
            "--dir",
            str(out),
        ],
        env=env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    local = [("0", "2"), ("1", "2"), ("0", "1")]  # node-a runs ranks 0, 1; node-b runs rank 2
    for rank, rec in enumerate(records):
        assert rec["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": local[rank][0],
            "WORLD_SIZE": "3",
            "LOCAL_SIZE": local[rank][1],
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_TEST_USER_VAR": "two words; $HOME",
        }
        assert rec["argv"][-1] == f"--local_rank={local[rank][0]}"
        assert rec["cwd"] == str(tmp_path)
        # Lightning detects TorchElasticEnvironment from this and uses these processes instead of spawning.
        assert rec["torchelastic"]


def test_sigterm_stops_every_host_of_a_multi_host_launch(tmp_path: Path) -> None:
    """ds-launch -> (ssh) -> one ds-launch per host -> workers -> grandchildren: SIGTERM at the top stops all."""
    bin_dir = _fake_remote_shells(tmp_path)
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
    launcher = subprocess.Popen(
        [
            *LAUNCH,
            "-H",
            str(tmp_path / "hostfile"),
            "--launcher",
            "ssh",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            WORKER,
            "--mode",
            "hang",
            "--dir",
            str(tmp_path),
        ],
        env=env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        pid_files = [tmp_path / "rank0.pids", tmp_path / "rank1.pids"]
        assert wait_files(pid_files, timeout=60), "the workers never started"
        pids = [int(x) for f in pid_files for x in f.read_text().split()]
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert "received SIGTERM; stopping every host" in err
        assert wait_gone(pids, timeout=10) == [], f"left running after SIGTERM: {pids}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_busy_master_port_is_named(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [
                *LAUNCH,
                "--num_procs",
                "1",
                "--master_port",
                str(port),
                "--rdzv_timeout",
                "5",
                WORKER,
                "--mode",
                "record",
            ],
            env=env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=tmp_path,
        )
    assert proc.returncode == 1
    assert f"node 0 could not serve the rendezvous at 127.0.0.1:{port}" in proc.stderr
    assert "address already in use" in proc.stderr
