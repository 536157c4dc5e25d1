"""Shared plumbing of the benchmarks: run a function on N fresh spawned ranks, write results files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import resource
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
RESULTS_ENV = "DS_STRATEGY_BENCH_RESULTS"  # another results folder (smoke tests: never the committed results)


# "LO-HI": take rendezvous ports from this range, not from the kernel's ephemeral ones. A port picked with
# bind(0) and released can be handed to another process (a gloo listener, another job's pick) before the
# ranks bind it; the test suite gives each pytest-xdist worker its own range below the ephemeral ports
# (tests/conftest.py), where neither the kernel nor another worker picks.
PORT_RANGE_ENV = "DS_STRATEGY_PORT_RANGE"
_port_cursor: int | None = None
_port_lock = threading.Lock()


def free_port() -> int:
    """A TCP port free on the loopback interface now (a rendezvous for a group of one or N ranks)."""
    span = os.environ.get(PORT_RANGE_ENV)
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    lo, hi = (int(x) for x in span.split("-"))
    global _port_cursor
    for _ in range(hi - lo):
        # A cursor, not a fresh pick: two calls of one process (launches side by side) never get the same port.
        with _port_lock:
            if _port_cursor is None:
                _port_cursor = random.randrange(hi - lo)  # processes of one worker start apart from each other
            port = lo + _port_cursor % (hi - lo)
            _port_cursor += 1
        with socket.socket() as s:  # no SO_REUSEADDR: a port bound or in use by anyone is refused
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={span}")


def _status_bytes(field: str) -> int | None:
    """A size field of /proc/self/status (reported in KiB) in bytes; None where it is missing."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak RSS. Linux: VmHWM, the high-water mark of the current address space. Not
    ru_maxrss: that keeps the RSS of the pre-exec copy of the parent, so a rank spawned by a parent that has
    grown (run_all runs the optimizer benchmark in-process first) would report the parent's size."""
    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def synchronize(device: str) -> None:
    """Wait for the device's queued work (``"cuda"``); nothing on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory_bytes(device: str) -> int:
    """Peak device memory allocated by torch's allocator; on the CPU, the process's peak RSS."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return peak_rss_bytes()


def file_backed_rss_bytes() -> int:
    """This process's resident pages that map files (RssFile: shared libraries' code and data, mapped
    files; not /dev/shm segments, which count as RssShmem). They only grow as new code paths run, so at
    the end of a run this bounds what they were at its peak; 0 where /proc is missing."""
    return _status_bytes("RssFile") or 0


def peak_step_tensor_bytes(step: Callable[[], None]) -> int:
    """Peak bytes of CPU tensor memory that ``step()`` allocates and has not yet freed, from the profiler's
    per-allocation records in time order: what the step's tensors need, without the allocator's retention
    that peak RSS also counts (glibc keeps freed multi-MiB blocks resident once its mmap threshold has
    grown). Frees of blocks allocated before the step are not recorded, so the figure errs high, alike for
    every peer."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )  # type: ignore[union-attr]
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak


# Smoke runs (run_all --quick, the test suite) may start their ranks from a forkserver that has imported
# torch once, instead of spawning each rank fresh: the seconds of that import per rank are most of a smoke
# run. Figures to quote come from fresh spawned ranks (the default). Variables that only take effect when a
# process starts (glibc's malloc tunables, OpenMP's) cannot be handed to a forked rank: a run whose values
# of them differ from the forkserver's spawns as before.
FORKSERVER_ENV = "DS_STRATEGY_BENCH_FORKSERVER"
_AT_EXEC = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "OMP_", "KMP_", "MKL_", "PYTHON")
_forkserver_env: dict[str, str] | None = None


def _start_method() -> str:
    """How run_ranks starts ranks: "forkserver" where FORKSERVER_ENV is set and the start-time variables
    match the server's, else "spawn"."""
    global _forkserver_env
    if os.environ.get(FORKSERVER_ENV) != "1" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    at_exec = {k: v for k, v in os.environ.items() if k.startswith(_AT_EXEC)}
    if _forkserver_env is None:  # the server starts with the first such run and keeps that environment
        mp.set_forkserver_preload(["torch", "torch.distributed"])
        _forkserver_env = at_exec
    return "forkserver" if at_exec == _forkserver_env else "spawn"


@contextlib.contextmanager
def environment(values: Mapping[str, str | None], restore: Iterable[str] = ()) -> Iterator[None]:
    """Set variables for the block (None: unset), e.g. glibc's malloc tunables for the ranks started inside
    it, then restore them, and the variables named in ``restore`` that the block may change itself: a
    benchmark of run_all must not change the next one's environment, nor a test the next test's."""
    saved = {k: os.environ.get(k) for k in (*values, *restore)}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(
    rank: int,
    world: int,
    port: int,
    out: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str = "gloo",
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None:  # a forked rank: the caller's environment now, not the forkserver's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (fresh: so peak RSS is the
    run's own; forked from a server that imported torch where FORKSERVER_ENV asks for it) over ``backend``
    ("nccl": rank r on GPU r); return every rank's JSON-serialisable result."""
    method = "spawn" if backend == "nccl" else _start_method()
    environ = dict(os.environ) if method == "forkserver" else None
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        try:
            mp.start_processes(
                _rank_main,
                args=(world_size, free_port(), out, fn, args, backend, environ),
                nprocs=world_size,
                start_method=method,
            )
        except mp.ProcessExitedException as err:
            # Every rank's result reached rank 0 before the file was written: a rank dying afterwards (seen
            # here: a sporadic SIGABRT inside process-group teardown) does not invalidate the measurement.
            if not Path(out).exists():
                raise
            print(f"note: {err} after the results were collected; teardown failure ignored", flush=True)
        return list(json.loads(Path(out).read_text()))


def results_dir() -> Path:
    """benchmarks/results, or the folder named by $DS_STRATEGY_BENCH_RESULTS; created on first use."""
    path = Path(os.environ.get(RESULTS_ENV) or RESULTS)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_results(name: str, payload: dict[str, Any], table: str) -> None:
    out = results_dir()
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (out / f"{name}.md").write_text(table + "\n")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _each(rank: int, world: int, fn: Callable[..., Any], items: Sequence[Any], args: tuple[Any, ...]) -> list[Any]:
    return [fn(rank, world, item, *args) for item in items]


def run_each(
    fn: Callable[..., Any],
    world_size: int,
    items: Sequence[Any],
    *args: Any,
    fresh: bool = True,
    backend: str = "gloo",
) -> Iterator[tuple[Any, list[Any] | Exception]]:
    """``fn(rank, world_size, item, *args)`` for every item, yielding (item, every rank's result) as each
    finishes: each item in its own fresh processes (``fresh``: its peak RSS is its own) or all of them one
    after another in one set of processes (smoke runs: one start-up of torch and the peers instead of one
    per item). An item that fails yields its exception instead (unfresh: every item of the set does): a
    peer that cannot run here is reported by the caller, not fatal."""
    for group in [[item] for item in items] if fresh else [list(items)]:
        try:
            per_rank = run_ranks(_each, world_size, fn, group, args, backend=backend)
        except Exception as err:
            yield from ((item, err) for item in group)
            continue
        for i, item in enumerate(group):
            yield item, [results[i] for results in per_rank]
