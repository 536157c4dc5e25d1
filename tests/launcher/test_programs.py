"""A program ds-launch needs (ssh, pdsh, mpirun, srun, or the script under --no_python) that is not on PATH
ends it with one line naming the program, the option that needs it and what to do, exit status 127, and
nothing started: no traceback, no half-started job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_strategy.launcher import launch
from ds_strategy.launcher import supervise as supervise_module
from ds_strategy.launcher.programs import EXIT_MISSING_PROGRAM, MissingProgramError
from ds_strategy.launcher.runners import Command
from ds_strategy.launcher.supervise import supervise
from tests.launcher.common import LAUNCH, env

TIMEOUT = 60


def _launch(tmp_path: Path, path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """ds-launch (started by absolute path to this Python) with PATH holding only ``path``."""
    (tmp_path / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
    return subprocess.run(
        [*LAUNCH, *argv],
        env=env(PATH=str(path)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == EXIT_MISSING_PROGRAM, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ds-launch: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "program", "option", "advice"),
    [
        (["--launcher", "srun"], "'srun'", "--launcher slurm (or srun)", "SLURM login or compute node"),
        (
            ["--launcher", "slurm", "-H", "hostfile"],
            "'srun'",
            "--launcher slurm (or srun)",
            "or use --launcher ssh or pdsh",
        ),
        (["--launcher", "openmpi", "-H", "hostfile"], "'mpirun'", "--launcher openmpi (or mpirun)", "Open MPI"),
        (["--launcher", "mpirun", "-H", "hostfile"], "'mpirun'", "--launcher openmpi (or mpirun)", "Open MPI"),
        (["--launcher", "mpich", "-H", "hostfile"], "'mpirun'", "--launcher mpich", "install MPICH"),
        (["--launcher", "pdsh", "-H", "hostfile"], "'pdsh'", "--launcher pdsh", "or use --launcher ssh"),
        (["--launcher", "ssh", "-H", "hostfile"], "'ssh'", "--launcher ssh", "install an OpenSSH client"),
        (["-H", "hostfile"], "'ssh'", "--launcher ssh", "install an OpenSSH client"),  # default: pdsh, else ssh
    ],
)
def test_missing_launcher_program_is_one_line_error(
    tmp_path: Path, flags: list[str], program: str, option: str, advice: str
) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    marker = tmp_path / "started"
    (tmp_path / "touch.py").write_text(f"open({str(marker)!r}, 'w')\n")
    line = _one_error_line(_launch(tmp_path, empty, *flags, "touch.py"))
    assert f"{option} runs the program {program}, which is not on PATH here" in line
    assert advice in line and "use --launcher torchrun" in line
    assert not marker.exists()


def test_pdsh_without_ssh_is_refused_before_pdsh_starts(tmp_path: Path) -> None:
    """pdsh reaches the hosts through ssh: with pdsh on PATH but not ssh, nothing may start."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started = tmp_path / "pdsh-started"
    (bin_dir / "pdsh").write_text(f"#!/bin/sh\ntouch {started}\n")
    (bin_dir / "pdsh").chmod(0o755)
    line = _one_error_line(_launch(tmp_path, bin_dir, "--launcher", "pdsh", "-H", "hostfile", "train.py"))
    assert "--launcher pdsh runs the program 'ssh', which is not on PATH here" in line
    assert not started.exists()


def test_dry_run_warns_and_still_prints_the_commands(tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = _launch(tmp_path, empty, "--launcher", "openmpi", "-H", "hostfile", "--dry_run", "train.py")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("ds-launch: warning: --launcher openmpi (or mpirun) runs the program 'mpirun'")
    assert lines[-1].startswith("ds-launch: mpirun -n 2 -H node-a:1,node-b:1 ")


def test_no_python_program_missing_or_not_runnable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    run = ["--num_procs", "1", "--no_python"]
    assert launch.run([*run, "no-such-program"]) == EXIT_MISSING_PROGRAM
    err = capsys.readouterr().err
    assert "--no_python runs 'no-such-program' as a program, but it is neither an executable file nor a command" in err
    # A bare name is looked up on PATH only, even when the file is in the working directory.
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    assert launch.run([*run, "train.sh"]) == EXIT_MISSING_PROGRAM
    assert "a name without '/' is looked up on PATH, where it is not: give its path as ./train.sh," in (
        capsys.readouterr().err
    )
    script.chmod(0o644)
    assert launch.run([*run, "./train.sh"]) == EXIT_MISSING_PROGRAM
    assert "the file is not executable: run 'chmod +x ./train.sh'" in capsys.readouterr().err


def test_supervisor_stops_what_started_when_a_later_command_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race after the PATH check (a program removed since, no permission): the started commands are stopped."""
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        return proc

    real_popen = subprocess.Popen
    monkeypatch.setattr(supervise_module.subprocess, "Popen", popen)
    waiter = Command((sys.executable, "-c", "import time; time.sleep(60)"))
    missing = Command((str(tmp_path / "gone" / "mpirun"), "-n", "2"))
    with pytest.raises(MissingProgramError, match=r"could not start '.*/gone/mpirun' \(No such file or directory\)"):
        supervise([waiter, missing], names=["a", "b"])
    assert len(started) == 1 and started[0].poll() is not None, "the started command was left running"
