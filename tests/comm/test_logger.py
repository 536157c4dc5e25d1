"""CommsLogger: nccl-tests bandwidth arithmetic, aggregation, op filtering from the typed config, verbose
and debug output, the summary table (rich and plain), and what a Communicator records on real ranks."""

from __future__ import annotations

import contextlib
import io
import sys
import time

import pytest
import torch

from ds_strategy.comm import CommsLogger, Communicator, bus_factor
from ds_strategy.config import CommsLoggerConfig, load_config
from tests.harness import run_distributed


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_reduce", 1, 0.0),
        ("all_reduce_coalesced", 4, 1.5),
        ("reduce_scatter", 4, 0.75),
        ("reduce_scatter_tensor", 2, 0.5),
        ("all_gather", 8, 0.875),
        ("all_gather_into_tensor", 4, 0.75),
        ("broadcast", 4, 1.0),
        ("barrier", 4, 1.0),
        ("all_reduce|train_step", 4, 1.5),  # debug names keep their formula
    ],
)
def test_bus_factor_follows_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bus_factor(op, n) == pytest.approx(factor)


def test_record_aggregates_count_bytes_latency_and_bandwidth() -> None:
    logger = CommsLogger()
    logger.record("all_reduce", nbytes=4_000_000, latency_s=0.002, world_size=4, path="gloo")
    logger.record("all_reduce", nbytes=4_000_000, latency_s=0.004, world_size=4, path="gloo")
    logger.record("all_reduce", nbytes=1_000_000, latency_s=0.001, world_size=4, path="gloo")
    logger.record("all_reduce", nbytes=4_000_000, latency_s=0.001, world_size=4, path="shm")
    logger.record("reduce_scatter", nbytes=8_000_000, latency_s=0.008, world_size=4, path="gloo-ar")
    rows = {(r.op, r.path): r for r in logger.summary()}
    gloo = rows["all_reduce", "gloo"]
    assert (gloo.count, gloo.total_bytes, gloo.msg_bytes, gloo.world_size) == (3, 9_000_000, None, 4)
    assert gloo.latency_mean_s == pytest.approx(0.007 / 3)
    assert (gloo.latency_min_s, gloo.latency_max_s) == (0.001, 0.004)
    assert gloo.algbw_gbps == pytest.approx(9_000_000 / 0.007 / 1e9)
    assert gloo.busbw_gbps == pytest.approx(gloo.algbw_gbps * 1.5)
    shm = rows["all_reduce", "shm"]
    assert (shm.count, shm.algbw_gbps, shm.busbw_gbps) == (1, pytest.approx(4.0), pytest.approx(6.0))
    rs = rows["reduce_scatter", "gloo-ar"]
    assert (rs.algbw_gbps, rs.busbw_gbps) == (pytest.approx(1.0), pytest.approx(0.75))
    by_size = {(r.op, r.path, r.msg_bytes): r.count for r in logger.summary(by_size=True)}
    assert by_size[("all_reduce", "gloo", 4_000_000)] == 2 and by_size[("all_reduce", "gloo", 1_000_000)] == 1
    logger.reset()
    assert logger.summary() == []


def test_prof_ops_from_the_typed_config() -> None:
    config = load_config(
        {"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce", "all_gather_into_tensor"]}}
    )
    logger = CommsLogger(config.comms_logger)
    assert logger.should_log("all_reduce") and logger.should_log("all_gather")
    assert not logger.should_log("reduce_scatter") and not logger.should_log("broadcast")
    assert logger.start("broadcast", nbytes=4, world_size=2, path="gloo") is None
    assert CommsLogger.from_config(config.comms_logger) is not None
    assert CommsLogger.from_config(load_config({}).comms_logger) is None  # disabled by default: no timing at all
    assert CommsLogger.from_config(None) is None
    disabled = CommsLogger(CommsLoggerConfig(enabled=False))
    assert not disabled.should_log("all_reduce")
    assert disabled.start("all_reduce", nbytes=4, world_size=2, path="gloo") is None


def test_start_stop_times_the_region_and_debug_names_the_caller() -> None:
    logger = CommsLogger(CommsLoggerConfig(enabled=True, debug=True))

    def train_step() -> None:
        timing = logger.start("all_reduce", nbytes=1000, world_size=2, path="gloo", device=torch.device("cpu"))
        time.sleep(0.02)
        logger.stop(timing)

    train_step()
    (row,) = logger.summary()
    assert row.op == "all_reduce|train_step"
    assert 0.02 <= row.latency_mean_s < 1.0


def test_verbose_prints_one_line_per_op_on_rank_zero_only() -> None:
    out0, out1 = io.StringIO(), io.StringIO()
    config = CommsLoggerConfig(enabled=True, verbose=True)
    CommsLogger(config, rank=0, file=out0).record("all_reduce", nbytes=2**20, latency_s=0.001, world_size=2, path="shm")
    CommsLogger(config, rank=1, file=out1).record("all_reduce", nbytes=2**20, latency_s=0.001, world_size=2, path="shm")
    line = out0.getvalue()
    assert line.count("\n") == 1 and out1.getvalue() == ""
    for part in ("all_reduce", "path shm", "1.00 MiB", "latency 1.000 ms", "algbw 1.049 GB/s", "busbw 1.049 GB/s"):
        assert part in line, line


def _filled() -> CommsLogger:
    logger = CommsLogger(rank=0)
    logger.record("all_gather", nbytes=3 * 2**20, latency_s=0.003, world_size=4, path="gloo-ar")
    logger.record("all_reduce", nbytes=1024, latency_s=0.0005, world_size=4, path="shm")
    return logger


def test_log_summary_prints_a_rich_table() -> None:
    pytest.importorskip("rich")
    out = io.StringIO()
    _filled().log_summary(file=out)
    text = out.getvalue()
    assert "Communication summary (rank 0)" in text
    for cell in ("all_gather", "gloo-ar", "3.00 MiB", "1.049", "0.786", "all_reduce", "1.00 KiB", "busbw (GB/s)"):
        assert cell in text, text


def test_log_summary_falls_back_to_plain_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich.console", None)  # as if rich were not installed
    out = io.StringIO()
    _filled().log_summary(file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "Communication summary (rank 0)"
    assert lines[2].split()[:4] == ["op", "path", "ranks", "count"]
    assert lines[4].split()[:4] == ["all_gather", "gloo-ar", "4", "1"]


def test_empty_summary_says_so() -> None:
    out = io.StringIO()
    CommsLogger(rank=3).log_summary(file=out)
    assert "rank 3): no collectives recorded" in out.getvalue()


def _logged_body(rank: int, world: int) -> tuple[list[tuple[str, str, int, int]], float, str]:
    logger = CommsLogger(CommsLoggerConfig(enabled=True, verbose=True))
    comm = Communicator(logger=logger, fast_path=False)
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        for _ in range(3):
            comm.all_reduce(torch.ones(1000))  # 4000 bytes
        comm.reduce_scatter_tensor(torch.empty(10, dtype=torch.bfloat16), torch.ones(10 * world, dtype=torch.bfloat16))
        comm.all_gather_into_tensor(torch.empty(6 * world), torch.ones(6))
        comm.broadcast(torch.ones(2, dtype=torch.float16))
        comm.barrier()
        handle = comm.all_reduce(torch.ones(8), async_op=True)
        time.sleep(0.05)  # async ops are timed at wait()
        handle.wait()
    rows = logger.summary(by_size=True)
    async_row = next(r for r in rows if r.op == "all_reduce" and r.msg_bytes == 32)
    return [(r.op, r.path, r.count, r.total_bytes) for r in rows], async_row.latency_mean_s, captured.getvalue()


@pytest.mark.multiprocess
def test_communicator_records_every_call() -> None:
    results = run_distributed(_logged_body, world_size=2)
    rows, async_latency, printed = results[0]
    assert rows == [
        ("all_gather", "gloo-ar", 1, 2 * 6 * 4),
        ("all_reduce", "gloo", 1, 32),
        ("all_reduce", "gloo", 3, 12000),
        ("barrier", "gloo", 1, 0),
        ("broadcast", "gloo", 1, 4),
        ("reduce_scatter", "gloo-ar", 1, 2 * 10 * 2),
    ]
    assert async_latency >= 0.05
    assert printed.count("[comms]") == 8
    assert results[1][2] == ""  # verbose lines come from rank 0 only
