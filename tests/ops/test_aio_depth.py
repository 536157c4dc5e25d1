"""The C++ aio engine's I/O backends: queue depth is real, the blocking fallback, selection and reporting.

Depth is checked without timing, through the engine's per-worker counter of transfers outstanding at the
device (submitted to the kernel, not yet reaped): an asynchronous backend must reach queue_depth on a
request of many blocks, the blocking one never exceeds one. Byte-for-byte behaviour of every backend is
tests/ops/test_aio.py's (its fixture runs each test on each backend).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_strategy import env
from ds_strategy.ops import aio_libs, builder
from ds_strategy.ops.__main__ import main as ops_main
from ds_strategy.ops.aio import ALIGNMENT, AioOptions, AsyncIO, aligned_empty, backend, compiled_backends

ASYNC = ["io_uring", "libaio"]


@pytest.fixture
def kernels(cpu_kernels: bool) -> list[str]:
    return compiled_backends()


def _force(monkeypatch: pytest.MonkeyPatch, name: str, built: list[str]) -> None:
    if name not in built:
        pytest.skip(f"only {', '.join(built)} built here: {name}'s -dev package was missing at build time")
    monkeypatch.setenv(env.AIO_BACKEND, name)


def _round_trip(io: AsyncIO, path: Path, nbytes: int) -> None:
    src = aligned_empty(nbytes, torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    dst = aligned_empty(nbytes, torch.uint8).zero_()
    with io.open(path, create=True) as f:
        io.write(src, f, 0).wait()
        io.read(dst, f, 0).wait()
    assert torch.equal(src, dst)


@pytest.mark.parametrize("name", ASYNC)
@pytest.mark.parametrize("single_submit", [False, True])
def test_async_backend_keeps_queue_depth_in_flight(
    kernels: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, single_submit: bool
) -> None:
    _force(monkeypatch, name, kernels)
    options = AioOptions(block_size=ALIGNMENT, queue_depth=8, thread_count=1, single_submit=single_submit)
    with AsyncIO(options) as io:
        assert io.io_backend == name
        _round_trip(io, tmp_path / "depth.bin", 64 * ALIGNMENT)
        # The submitter queues the first 8 blocks under one hold of the engine's lock, so the worker finds
        # them together and issues all 8 (single_submit: one system call each) before reaping any.
        assert io.device_max_in_flight == [8]
    assert io.device_max_in_flight == [8]  # still readable once the engine is closed


@pytest.mark.parametrize("name", ASYNC)
def test_depth_is_per_thread(kernels: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    _force(monkeypatch, name, kernels)
    options = AioOptions(block_size=ALIGNMENT, queue_depth=4, thread_count=2)
    with AsyncIO(options) as io:
        _round_trip(io, tmp_path / "threads.bin", 64 * ALIGNMENT)
        assert len(io.device_max_in_flight) == 2
        assert max(io.device_max_in_flight) == 4 and all(n <= 4 for n in io.device_max_in_flight)
        assert io.max_in_flight <= 16  # 2 x queue_depth x thread_count blocks queued or transferring


def test_blocking_fallback_is_forced_by_the_environment(
    kernels: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(env.AIO_BACKEND, "blocking")
    assert backend() == "blocking"
    with AsyncIO(AioOptions(block_size=ALIGNMENT, queue_depth=8, thread_count=2)) as io:
        assert io.backend == "kernel" and io.io_backend == "blocking"
        _round_trip(io, tmp_path / "blocking.bin", 64 * ALIGNMENT)
        assert all(n <= 1 for n in io.device_max_in_flight) and max(io.device_max_in_flight) == 1


def test_python_backend_reports_one_transfer_per_thread(tmp_path: Path) -> None:
    with AsyncIO(AioOptions(block_size=ALIGNMENT, queue_depth=8, thread_count=2), backend="python") as io:
        assert io.io_backend == "blocking"
        _round_trip(io, tmp_path / "python.bin", 64 * ALIGNMENT)
        assert all(n <= 1 for n in io.device_max_in_flight) and max(io.device_max_in_flight) == 1


def test_auto_picks_the_best_compiled_backend(kernels: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.AIO_BACKEND, raising=False)
    assert kernels[-1] == "blocking" and set(kernels) <= {"io_uring", "libaio", "blocking"}
    with AsyncIO() as io:
        assert io.io_backend == backend()
    # The first compiled one, unless this kernel refuses it (a sandbox without io_uring): then the next.
    assert backend() in kernels


def test_compiled_backends_follow_the_build_flags(kernels: list[str]) -> None:
    assert kernels == aio_libs.compiled_backends(builder.cpu_spec().cflags)


def test_unknown_backend_name_in_the_environment(kernels: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.AIO_BACKEND, "uring")
    with pytest.raises(
        ValueError,
        match=r"DS_STRATEGY_AIO_BACKEND='uring': not an I/O backend of the aio engine; expected one of auto, io_uring",
    ):
        AsyncIO()


def test_a_backend_that_was_not_built_is_refused(kernels: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    missing = [name for name in ASYNC if name not in kernels]
    if not missing:
        pytest.skip("both io_uring and libaio are built here")
    monkeypatch.setenv(env.AIO_BACKEND, missing[0])
    with pytest.raises(RuntimeError, match=f"the {missing[0]} I/O backend cannot be used here: not compiled in"):
        AsyncIO()


def test_build_command_reports_the_backend(kernels: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert ops_main(["build"]) == 0
    out = capsys.readouterr().out
    assert f"aio I/O backend: {backend()} (compiled: {', '.join(kernels)})" in out


def test_library_detection_needs_header_and_library(tmp_path: Path) -> None:
    lib = tmp_path / "prefix" / "lib" / "x86_64-linux-gnu" / "liburing.so"
    lib.parent.mkdir(parents=True)
    lib.touch()
    assert aio_libs._include_dir(lib, "liburing.h") is None  # no header beside it
    (tmp_path / "prefix" / "include").mkdir()
    (tmp_path / "prefix" / "include" / "liburing.h").touch()
    assert aio_libs._include_dir(lib, "liburing.h") == tmp_path / "prefix" / "include"
    assert aio_libs.compiled_backends(("-O3", "-DDS_AIO_HAVE_LIBAIO")) == ["libaio", "blocking"]
