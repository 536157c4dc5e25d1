"""Shared plumbing of the benchmarks: run a function on N fresh spawned ranks, write results files."""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rank_main(rank: int, world: int, port: int, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (fresh: so peak RSS is the
    run's own); return every rank's JSON-serialisable result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        try:
            mp.start_processes(
                _rank_main, args=(world_size, _free_port(), out, fn, args), nprocs=world_size, start_method="spawn"
            )
        except mp.ProcessExitedException as err:
            # Every rank's result reached rank 0 before the file was written: a rank dying afterwards (seen
            # here: a sporadic SIGABRT inside process-group teardown) does not invalidate the measurement.
            if not Path(out).exists():
                raise
            print(f"note: {err} after the results were collected; teardown failure ignored", flush=True)
        return list(json.loads(Path(out).read_text()))


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_results(name: str, payload: dict[str, Any], table: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / f"{name}.md").write_text(table + "\n")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
