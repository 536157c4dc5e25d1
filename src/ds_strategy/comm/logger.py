"""The comms logger (config key ``comms_logger``): per collective, how often, how big, how fast, which path.

    logger = CommsLogger(config.comms_logger)          # a CommsLoggerConfig; None means enabled, all ops
    comm = Communicator(group, logger=logger)
    ...
    logger.log_summary()                               # a table; logger.summary() returns the rows

Recorded per call: operation, message size in bytes, latency, world size and the path that ran (``shm``,
``gloo``, ``gloo-ar`` = gloo emulated through one all_reduce, ``nccl``, ``local`` for a group of one).
Bandwidths follow nccl-tests (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
``algbw = size / latency`` and ``busbw = algbw * factor`` with factor ``2(n-1)/n`` for all_reduce,
``(n-1)/n`` for reduce_scatter and all_gather (whose size is the full, n-shard buffer) and 1 for
broadcast. Asynchronous operations are timed from launch to ``wait()``. CUDA tensors are synchronised
around the timed region so the latency is the device's. ``verbose`` prints one line per operation on global
rank 0; ``debug`` appends the calling function to the operation name; ``prof_all=False`` limits logging to
the names in ``prof_ops`` (DeepSpeed's names ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are
accepted for ``all_gather`` and ``reduce_scatter``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from ds_strategy.config.model import CommsLoggerConfig
from ds_strategy.table import format_plain

if TYPE_CHECKING:
    import torch

OP_ALIASES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "allreduce": "all_reduce",
    "inference_all_reduce": "all_reduce",
}

COLUMNS = (
    "op",
    "path",
    "ranks",
    "count",
    "msg size",
    "total bytes",
    "lat mean (ms)",
    "lat min (ms)",
    "lat max (ms)",
    "algbw (GB/s)",
    "busbw (GB/s)",
)


def canonical_op(name: str) -> str:
    return OP_ALIASES.get(name, name)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``op`` on ``world_size`` ranks (1 for ops without a formula)."""
    n = world_size
    base = canonical_op(op.split("|", 1)[0]).removesuffix("_coalesced")
    if n < 1:
        raise ValueError(f"bus_factor: world_size must be >= 1, got {n}")
    if base == "all_reduce":
        return 2.0 * (n - 1) / n
    if base in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class CommsStat:
    """One summary row: every call of ``op`` that ran on ``path`` (and, if grouped by size, had ``msg_bytes``).

    Latencies in seconds, bandwidths in GB/s (1e9 bytes). ``algbw_gbps`` is total bytes over total time.
    """

    op: str
    path: str
    world_size: int
    count: int
    total_bytes: int
    msg_bytes: int | None
    latency_mean_s: float
    latency_min_s: float
    latency_max_s: float
    algbw_gbps: float
    busbw_gbps: float

    def row(self) -> tuple[str, ...]:
        size = (
            _human_bytes(self.msg_bytes) if self.msg_bytes is not None else _human_bytes(self.total_bytes // self.count)
        )
        if self.msg_bytes is None and self.count > 1:
            size = f"~{size}"
        return (
            self.op,
            self.path,
            str(self.world_size),
            str(self.count),
            size,
            _human_bytes(self.total_bytes),
            f"{self.latency_mean_s * 1e3:.3f}",
            f"{self.latency_min_s * 1e3:.3f}",
            f"{self.latency_max_s * 1e3:.3f}",
            f"{self.algbw_gbps:.3f}",
            f"{self.busbw_gbps:.3f}",
        )


@dataclass
class _Accumulator:
    count: int = 0
    total_s: float = 0.0
    min_s: float = float("inf")
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.min_s = min(self.min_s, seconds)
        self.max_s = max(self.max_s, seconds)


@dataclass(frozen=True)
class Timing:
    """An operation in flight: started by ``CommsLogger.start``, recorded by ``CommsLogger.stop``."""

    op: str
    nbytes: int
    world_size: int
    path: str
    device: torch.device | None
    start: float


_Key = tuple[str, str, int, int]  # op, path, world size, message bytes


class CommsLogger:
    """Accumulates collective timings (see the module docstring). One per communicator or shared by several."""

    def __init__(self, config: CommsLoggerConfig | None = None, *, rank: int | None = None, file: TextIO | None = None):
        self.config = config if config is not None else CommsLoggerConfig(enabled=True)
        self._rank = rank
        self._file = file
        self._prof_ops = frozenset(canonical_op(op) for op in self.config.prof_ops)
        self._stats: dict[_Key, _Accumulator] = {}

    @classmethod
    def from_config(cls, config: CommsLoggerConfig | None, **kwargs: Any) -> CommsLogger | None:
        """A logger for an enabled ``comms_logger`` block, else None (communicators then skip all timing)."""
        return cls(config, **kwargs) if config is not None and config.enabled else None

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def should_log(self, op: str) -> bool:
        if not self.config.enabled:
            return False
        return self.config.prof_all or canonical_op(op) in self._prof_ops

    # ---- recording ---------------------------------------------------------------------------------
    def start(
        self, op: str, *, nbytes: int, world_size: int, path: str, device: torch.device | None = None
    ) -> Timing | None:
        """Begin timing ``op``; None (and no overhead later) when this op is not logged."""
        if not self.should_log(op):
            return None
        _sync(device)
        if self.config.debug:
            op = f"{op}|{_caller()}"
        return Timing(op, int(nbytes), int(world_size), path, device, time.perf_counter())

    def stop(self, timing: Timing | None) -> None:
        if timing is None:
            return
        _sync(timing.device)
        self.record(
            timing.op,
            nbytes=timing.nbytes,
            latency_s=time.perf_counter() - timing.start,
            world_size=timing.world_size,
            path=timing.path,
        )

    def record(self, op: str, *, nbytes: int, latency_s: float, world_size: int, path: str) -> None:
        """Add one completed call (also usable directly, e.g. by code timing its own collectives)."""
        self._stats.setdefault((op, path, world_size, nbytes), _Accumulator()).add(latency_s)
        if self.config.verbose and self._is_rank0():
            algbw = nbytes / latency_s / 1e9 if latency_s > 0 else 0.0
            print(
                f"[comms] {op} | path {path} | ranks {world_size} | msg size {_human_bytes(nbytes)} | "
                f"latency {latency_s * 1e3:.3f} ms | algbw {algbw:.3f} GB/s | "
                f"busbw {algbw * bus_factor(op, world_size):.3f} GB/s",
                file=self._file if self._file is not None else sys.stdout,
                flush=True,
            )

    def reset(self) -> None:
        self._stats.clear()

    # ---- reporting ---------------------------------------------------------------------------------
    def summary(self, *, by_size: bool = False) -> list[CommsStat]:
        """Rows per (op, path, world size), or per message size too with ``by_size``; sorted by op."""
        merged: dict[tuple[str, str, int, int | None], list[tuple[int, _Accumulator]]] = {}
        for (op, path, world, nbytes), acc in self._stats.items():
            merged.setdefault((op, path, world, nbytes if by_size else None), []).append((nbytes, acc))
        rows = []
        for (op, path, world, size), parts in sorted(
            merged.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] or 0)
        ):
            count = sum(acc.count for _, acc in parts)
            total_bytes = sum(nbytes * acc.count for nbytes, acc in parts)
            total_s = sum(acc.total_s for _, acc in parts)
            algbw = total_bytes / total_s / 1e9 if total_s > 0 else 0.0
            rows.append(
                CommsStat(
                    op=op,
                    path=path,
                    world_size=world,
                    count=count,
                    total_bytes=total_bytes,
                    msg_bytes=size,
                    latency_mean_s=total_s / count,
                    latency_min_s=min(acc.min_s for _, acc in parts),
                    latency_max_s=max(acc.max_s for _, acc in parts),
                    algbw_gbps=algbw,
                    busbw_gbps=algbw * bus_factor(op, world),
                )
            )
        return rows

    def log_summary(self, *, by_size: bool = False, file: TextIO | None = None) -> None:
        """Print ``summary()`` as a table (rich when installed, aligned text otherwise) on this rank."""
        rows = [stat.row() for stat in self.summary(by_size=by_size)]
        rank = self._current_rank()
        title = "Communication summary" + ("" if rank is None else f" (rank {rank})")
        if not rows:
            title += ": no collectives recorded"
        _print_table(title, rows, file if file is not None else self._file)

    # ---- helpers -----------------------------------------------------------------------------------
    def _current_rank(self) -> int | None:
        if self._rank is not None:
            return self._rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None

    def _is_rank0(self) -> bool:
        return (self._current_rank() or 0) == 0


def _print_table(title: str, rows: list[tuple[str, ...]], file: TextIO | None) -> None:
    """rich when installed (at least 160 columns wide when not writing to a terminal, so logs keep every
    column), aligned plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_plain(title, COLUMNS, rows), file=file)
        return
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if i < 2 else "right")
    for row in rows:
        table.add_row(*row)
    console = Console(file=file)
    if not console.is_terminal and console.width < 160:
        console = Console(file=file, width=160)
    console.print(table)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _caller() -> str:
    """The first function on the stack outside this package's comm layer (``debug`` mode)."""
    frame = sys._getframe(1)
    while frame is not None:
        if not str(frame.f_globals.get("__name__", "")).startswith("ds_strategy.comm"):
            return frame.f_code.co_name
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
