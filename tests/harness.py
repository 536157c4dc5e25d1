"""The one multi-process test harness: run a function on N ranks over gloo, never hang.

    from tests.harness import run_distributed

    def body(rank: int, world_size: int, scale: float) -> float:   # module level: it is pickled by name
        t = torch.ones(1) * rank * scale
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_distributed(body, world_size=2, args=(2.0,)) == [2.0, 2.0]

Workers are spawned once per world size and reused by every test (spawning costs seconds); each call
gets a fresh default process group that rendezvouses through a ``FileStore`` in a fresh temp file (no
port to pick, so no free-port race with other test runs on the machine), torn down afterwards. A failing
rank fails the test with every rank's traceback; a rank that does not finish within ``timeout`` seconds
fails it with the stacks of the hanging ranks (dumped through faulthandler), and the pool is replaced. A
fresh pool's start-up (spawning, importing torch) is waited for before its first call, so that ``timeout``
counts the call alone.
A rank that calls ``pytest.skip`` skips the test, unless another rank raised: a raise outweighs a skip,
as in PyTorch's MultiProcessTestCase (so skip on every rank, or before the first collective, since a
peer left in a collective by the skipping rank raises when that rank's group goes away).

MASTER_ADDR/MASTER_PORT are still set for every call, for bodies that rendezvous themselves
(``init_process_group=False``: Lightning's ``TorchElasticEnvironment`` and ``init_distributed`` read them).
That port is held by the parent (bound with SO_REUSEADDR, never listening) for the whole call, so the
kernel cannot hand it to anyone else while rank 0's TCPStore binds it (TCPStore binds with SO_REUSEADDR
too).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from benchmarks.common import environment, free_port

DEFAULT_TIMEOUT = float(os.environ.get("DS_TEST_TIMEOUT", "120"))
FAILURE_GRACE = 5.0  # seconds the other ranks get to finish once one rank has failed


class DistributedTestError(AssertionError):
    """One or more ranks raised, died or hung; the message holds every rank's story."""


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port that stays reserved while the block runs: the socket is bound (SO_REUSEADDR, not
    listening), so neither the kernel's ``bind(0)`` nor ``free_port`` hands it out, yet a TCPStore that
    binds it with SO_REUSEADDR (as c10d does) and listens still can. Under the suite the port comes from
    this worker's range (``DS_STRATEGY_PORT_RANGE``, tests/conftest.py)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", free_port()))
        yield int(s.getsockname()[1])


@dataclass
class _Task:
    task_id: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    port: int
    store_path: str  # the FileStore of this call's default group: a fresh file, never reused
    timeout: float
    init_process_group: bool
    env: dict[str, str]


def _dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# What a rank reports for a task; the task id 0 is its start-up (a fresh pool's imports, before any task).
_OK, _FAILED, _SKIPPED = "ok", "failed", "skipped"
_READY = 0
STARTUP_TIMEOUT = 180.0  # spawning and importing, under a loaded machine


def _all_ranks_done(timeout: float, world_size: int) -> None:
    """Wait (in the rendezvous store, not a collective that could pair with one a peer is stuck in) until
    every rank has finished the body, or the task's time is up. Without it a rank could tear its groups
    down while a peer is still connecting one the body made with ``dist.new_group`` and no collective after
    it ("Connection closed by peer" in connectFullMesh; seen in CI). Results are already sent: a peer that
    never arrives (failed, hanging) delays only this worker, whose pool is then replaced."""
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + timeout
    store.add("harness_done", 1)
    while store.add("harness_done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.005)


def _worker_main(
    rank: int,
    world_size: int,
    tasks: Any,
    results: Any,
    sys_path: list[str],
    stack_file: str,
    process_env: dict[str, str],
) -> None:
    sys.path[:] = sys_path
    os.environ.update(process_env)  # before any task imports the package (e.g. DS_STRATEGY_DEVICE_STRICT)
    # The parent sends SIGUSR1 to a rank that hangs; faulthandler writes every thread's stack here.
    stack_out = open(stack_file, "w")  # noqa: SIM115 - lives as long as the worker
    faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    results.put((_READY, rank, _OK, None))
    while True:
        task = tasks.get()
        if task is None:
            return
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(task.port),
        }
        env.update(task.env)
        with environment(env):
            try:
                if task.init_process_group:
                    dist.init_process_group(
                        "gloo",
                        store=dist.FileStore(task.store_path, world_size),
                        rank=rank,
                        world_size=world_size,
                        timeout=datetime.timedelta(seconds=task.timeout),
                    )
                    # Every rank's gloo connections are up before any body runs: a body without collectives
                    # could otherwise finish and destroy its group while a slower peer is still connecting,
                    # which fails that peer's init ("Connection closed by peer" in connectFullMesh; seen in CI).
                    dist.barrier()
                value = task.fn(rank, world_size, *task.args, **task.kwargs)
                results.put((task.task_id, rank, _OK, _dumps(value)))
            except pytest.skip.Exception as skipped:
                results.put((task.task_id, rank, _SKIPPED, skipped.msg))
            except BaseException:
                results.put((task.task_id, rank, _FAILED, traceback.format_exc()))
            finally:
                if dist.is_initialized():
                    _all_ranks_done(task.timeout, world_size)
                    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned processes that run tasks until closed; ``process_env`` is set in each
    process before its first task (for variables read once, at import)."""

    def __init__(self, world_size: int, process_env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._stack_dir = tempfile.mkdtemp(prefix="ds_harness_")  # also holds the calls' FileStores
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._next_id = 0
        self._started = False
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(
                    r,
                    world_size,
                    self._tasks[r],
                    self._results,
                    list(sys.path),
                    self._stack_path(r),
                    dict(process_env or {}),
                ),
                daemon=True,
                name=f"ds-test-rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def _stack_path(self, rank: int) -> str:
        return str(Path(self._stack_dir) / f"rank{rank}.stack")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        init_process_group: bool,
        env: dict[str, str],
    ) -> list[Any]:
        """Return the per-rank results; raise DistributedTestError (the pool is then unusable) or skip."""
        if not self._started:
            self._await_start()
        self._next_id += 1
        store_path = str(Path(self._stack_dir) / f"store{self._next_id}")
        with held_port() as port:
            task = _Task(self._next_id, fn, args, kwargs, port, store_path, timeout, init_process_group, env)
            for q in self._tasks:
                q.put(task)
            done = self._collect(task.task_id, timeout)
        hanging = [r for r in range(self.world_size) if r not in done]
        failed = {r: payload for r, (status, payload) in sorted(done.items()) if status == _FAILED}
        skipped = {r: payload for r, (status, payload) in sorted(done.items()) if status == _SKIPPED}
        if not hanging and not failed and not skipped:
            return [torch.load(io.BytesIO(done[r][1]), weights_only=False) for r in range(self.world_size)]
        if skipped and not failed:
            reasons = "; ".join(f"rank {r}: {msg}" for r, msg in skipped.items())
            if hanging:  # peers left waiting in a collective for the rank that skipped
                self.kill()
                reasons += f" (ranks {hanging} were still running and were stopped)"
            pytest.skip(reasons)
        raise DistributedTestError(self._report(fn, failed, hanging, timeout))

    def _await_start(self) -> None:
        """Wait until every rank has started (a task's timeout counts the task, not the pool's start-up)."""
        started = self._collect(_READY, STARTUP_TIMEOUT)
        late = [r for r in range(self.world_size) if r not in started]
        failed = {r: payload for r, (status, payload) in started.items() if status != _OK}
        if late or failed:
            self.kill()
            raise DistributedTestError(f"harness ranks did not start: late {late}, failed {failed}")
        self._started = True

    def _collect(self, task_id: int, timeout: float) -> dict[int, tuple[str, Any]]:
        """Every rank's (status, payload) that came back in time; a rank that died counts as failed."""
        done: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size and time.monotonic() < deadline:
            try:
                answer_id, rank, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in done]
                for r in dead:
                    done[r] = (_FAILED, f"rank {r} died with exit code {self.procs[r].exitcode}")
                continue
            if answer_id != task_id:
                continue  # a late answer from a task that already failed
            done[rank] = (status, payload)
            if status != _OK:  # the others may wait for this rank in a collective: do not wait long
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
        return done

    def _report(self, fn: Callable[..., Any], failed: dict[int, str], hanging: list[int], timeout: float) -> str:
        lines = [f"{getattr(fn, '__qualname__', fn)} on {self.world_size} ranks:"]
        for r, tb in failed.items():
            lines.append(f"--- rank {r} raised ---\n{tb}")
        if hanging:
            for r in hanging:
                with contextlib.suppress(ProcessLookupError):
                    if self.procs[r].pid is not None:
                        os.kill(self.procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)
            reason = "after another rank failed" if failed else f"within the {timeout:.0f}s timeout"
            lines.append(f"--- ranks {hanging} did not finish {reason} (hanging); their stacks: ---")
            for r in hanging:
                stack = Path(self._stack_path(r)).read_text(errors="replace")[-4000:]
                lines.append(f"[rank {r}]\n{stack}")
        return "\n".join(lines)

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._remove_files()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self._remove_files()

    def _remove_files(self) -> None:
        shutil.rmtree(self._stack_dir, ignore_errors=True)


_pools: dict[tuple[int, frozenset[tuple[str, str]]], WorkerPool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    init_process_group: bool = True,
    env: dict[str, str] | None = None,
    process_env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the per-rank results.

    ``fn`` must be importable by name (module level). With ``init_process_group`` the default gloo group
    (FileStore rendezvous) is ready when ``fn`` starts; RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are set in
    the environment either way, for ``fn`` to rendezvous itself (the port is reserved for this call).
    ``pytest.skip`` on any rank skips the test. ``env`` adds variables for this call only; ``process_env`` runs it in a
    pool of its own whose processes have those variables from the start (for settings read at import).
    """
    key = (world_size, frozenset((process_env or {}).items()))
    pool = _pools.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _pools[key] = WorkerPool(world_size, process_env)
    try:
        results = pool.run(fn, args, kwargs or {}, timeout, init_process_group, env or {})
    except pytest.skip.Exception:
        if not pool.alive():
            _pools.pop(key, None)
        raise
    except DistributedTestError:
        # Ranks may be stuck in a collective: replace the whole pool rather than reuse it.
        pool.kill()
        _pools.pop(key, None)
        raise
    return results


def shutdown_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


atexit.register(shutdown_pools)
