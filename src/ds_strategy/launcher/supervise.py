"""Run the commands of a multi-host launch (one ssh per host, or one pdsh / mpirun / srun) and keep them
together: the first one to fail, or a SIGINT / SIGTERM / SIGHUP to the launcher, stops all of them.

Each command starts in its own session so it can be stopped with its children (``killpg``): SIGTERM first,
then SIGKILL after ``grace`` seconds. mpirun and srun forward SIGTERM to their ranks; ssh -tt hangs up the
remote shell, which ends the remote ds-launch and, through its elastic agent, that node's workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from .programs import MissingProgramError
from .runners import Command

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signum)


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _killpg(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in alive:
        if p.poll() is None:
            _killpg(p, signal.SIGKILL)
            p.wait()


def supervise(commands: Sequence[Command], *, names: Sequence[str], poll: float = 0.1) -> int:
    """Start every command, wait for all; return 0, the first failure's exit status, or 128+signal.

    Raises MissingProgramError (after stopping those already started) when a command cannot be started."""
    previous = {sig: signal.signal(sig, _raise_stop) for sig in _STOP_SIGNALS}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd in commands:
            try:
                procs.append(subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, start_new_session=True))
            except OSError as exc:
                # The programs were found before (programs.py); this is a race or a permission problem.
                stop_all(procs)
                raise MissingProgramError(
                    f"could not start {cmd.argv[0]!r} ({exc.strerror or exc}); stopped every process already "
                    f"started: check that {cmd.argv[0]} is installed and executable here"
                ) from exc
        while True:
            codes = [p.poll() for p in procs]
            for name, code in zip(names, codes, strict=True):
                if code is not None and code != 0:
                    print(f"ds-launch: {name} exited with code {code}; stopping the others", file=sys.stderr)
                    stop_all(procs)
                    return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll)
    except _Stop as stop:
        print(f"ds-launch: received {signal.Signals(stop.signum).name}; stopping every host", file=sys.stderr)
        stop_all(procs)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
