"""Runs the docs' python commands in children forked from one process that has imported torch and lightning.

A python block of a page runs as ``python SCRIPT``, and a parse check as ``python -m MODULE --help`` or
``python -c CODE``. Started fresh, each such process spends most of its time importing torch and lightning
(about 6 s on a 2-core machine), once per block. The host imports them once; for each command it forks a
child that takes the command's working directory, environment and argv, runs it as the interpreter would
(``runpy`` with ``__name__ == "__main__"``, ``SystemExit`` as the exit code, non-daemon threads joined and
``atexit`` run before it exits) and writes its output, stdout and stderr together, to a file.

A multi-rank block (``ranks=N``) runs the same way on N children forked side by side, each with the
variables torchrun's agent gives a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...) plus ``LOCAL_SIZE`` and ``OMP_NUM_THREADS=1`` as
``ds-launch`` adds them; their output goes to one file, and when one rank fails the others get a few
seconds to finish before they are killed (as the agent stops the group). The launchers themselves are
tested by their own tests (tests/launcher).

What a child does not get fresh: the modules the host imported (torch, lightning and what they import),
already imported before the command's environment is set. ds_strategy itself is never imported by the host,
so ``DS_ACCELERATOR`` and the other variables it reads still take effect. Shell blocks still start their
own processes. Where ``os.fork`` does not exist, ``BlockHost.usable`` is False and the caller starts
processes as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The host's program: read one JSON request per line, fork, report the child's pid, then its exit code.
_HOST = r"""
import atexit, json, os, runpy, signal, sys, threading, time, traceback
import torch, lightning  # the start-up every block would pay; no computation, so no OpenMP team to fork

def child(req, own_group=True):
    if own_group:
        os.setpgid(0, 0)  # the caller kills the whole group on a timeout
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # OpenMP read it when the host loaded torch: apply it now
        torch.set_num_threads(int(threads))
    kind, target, args = req["kind"], req["target"], req["args"]
    code = 0
    try:
        if kind == "script":
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        elif kind == "module":
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)

def rank_env(rank, world, port):
    # What torchrun's agent sets for a worker of a one-node job, and what ds-launch adds (launcher/local.py).
    # No TORCHELASTIC_USE_AGENT_STORE: there is no agent store, rank 0 serves the TCPStore itself.
    env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank, "ROLE_NAME": "default",
           "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "ROLE_WORLD_SIZE": world, "GROUP_WORLD_SIZE": 1,
           "LOCAL_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "TORCHELASTIC_RUN_ID": f"docs-{port}", "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}
    return {k: str(v) for k, v in env.items()}

def ranks(req):
    # The launcher's part: fork the ranks, wait for them; the first failure is the exit code, and the others
    # (perhaps waiting for it in a collective) are killed after a grace.
    os.setpgid(0, 0)
    world, pids, code, deadline = req["ranks"], {}, 0, None
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            req["env"].setdefault("OMP_NUM_THREADS", "1")
            req["env"].update(rank_env(r, world, req["port"]))
            child(req, own_group=False)
        pids[pid] = r
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for p in pids:
                    os.kill(p, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        rank, rc = pids.pop(pid), os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code, deadline = rc, time.monotonic() + 5
            with open(req["out"], "a") as f:
                f.write(f"\n<block host> rank {rank} exited with code {rc}\n")
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        ranks(req) if req.get("ranks") else child(req)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class HostTimeout(Exception):
    """The command ran past its time; its process group was killed. ``output`` holds what it printed."""

    def __init__(self, output: str) -> None:
        super().__init__("timed out")
        self.output = output


class BlockHost:
    """One host process (started on first use, per pytest process); ``run`` one command at a time."""

    usable = hasattr(os, "fork") and sys.platform.startswith("linux")

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""  # what the host wrote past the last full line

    @staticmethod
    def command(argv: list[str]) -> tuple[str, str, list[str]] | None:
        """(kind, target, args) for ``[python, SCRIPT, ...]``, ``[python, -m, MODULE, ...]`` or ``[python, -c,
        CODE, ...]`` with this interpreter; None for anything else (it runs as a process)."""
        if len(argv) < 2 or argv[0] != sys.executable:
            return None
        if argv[1] in ("-m", "-c"):
            if len(argv) < 3:
                return None
            return ("module" if argv[1] == "-m" else "code"), argv[2], argv[3:]
        if argv[1].startswith("-"):
            return None
        return "script", argv[1], argv[2:]

    def _start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._pending = b""
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _HOST],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
                start_new_session=True,
            )
        return self._proc

    def _reply(self, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, int] | None:
        """The host's next line, or None when none came by ``deadline`` (read unbuffered, so select sees it)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - _now()))
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the docs block host (pid {proc.pid}) exited with code {proc.wait()}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return dict(json.loads(line))

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float, ranks: int = 0, port: int = 0
    ) -> tuple[int, str]:
        """Run ``argv`` (see ``command``) in a forked child, or on ``ranks`` children that meet at ``port``;
        (exit code, output). Raises HostTimeout."""
        parsed = self.command(argv)
        assert parsed is not None, argv
        kind, target, args = parsed
        proc = self._start(env)
        assert proc.stdin is not None
        fd, name = tempfile.mkstemp(prefix="ds_docs_block_", suffix=".txt")  # outside cwd: a block may list it
        os.close(fd)
        out = Path(name)
        request = {"kind": kind, "target": target, "args": args, "cwd": str(cwd), "env": env, "out": str(out)}
        request |= {"ranks": ranks, "port": port}
        proc.stdin.write((json.dumps(request) + "\n").encode())
        started = self._reply(proc, _now() + 120)  # the first request waits for the imports
        if started is None:
            self.close()
            raise RuntimeError("the docs block host did not fork within 120 s")
        done = self._reply(proc, _now() + timeout)
        if done is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started["pid"], signal.SIGKILL)
            self._reply(proc, _now() + 60)
            raise HostTimeout(_read(out))
        return done["code"], _read(out)

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None


def _now() -> float:
    return time.monotonic()


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    path.unlink(missing_ok=True)
    return text
