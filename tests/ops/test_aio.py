"""The asynchronous I/O engine (ds_strategy.ops.aio): every backend, block for block the same behaviour.

Each test runs on the Python backend and on the C++ engine with each I/O backend it was built with
(io_uring, libaio, blocking: DS_STRATEGY_AIO_BACKEND set per test); tests/ops/test_aio_depth.py checks that
the asynchronous ones really keep queue_depth transfers outstanding.

Round trips over dtypes, sizes that are not multiples of the block or of ALIGNMENT, aligned and unaligned
tensors and offsets; O_DIRECT on /tmp (ext4) and the buffered fallback on /dev/shm (tmpfs refuses it);
owner-only file mode; error messages (short read, ENOSPC from /dev/full); option validation; the queue
bound; overlap (read/write return before the transfer completes, and waiting releases the GIL).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_strategy import env
from ds_strategy.config import AioConfig
from ds_strategy.ops.aio import ALIGNMENT, AioError, AioOptions, AsyncIO, _plan, aligned_empty, compiled_backends
from tests.gil import spinner_ticks_during

SMALL = AioOptions(block_size=2 * ALIGNMENT, queue_depth=4, thread_count=2)
SHM = Path("/dev/shm")


def _direct_supported(directory: Path) -> bool:
    probe = directory / ".odirect_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture(params=["io_uring", "libaio", "blocking", "python"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The AsyncIO backend to pass: "python", or "kernel" with its I/O backend forced to the param."""
    if request.param == "python":
        return "python"
    request.getfixturevalue("cpu_kernels")
    if request.param not in compiled_backends():
        pytest.skip(f"the C++ engine was built without {request.param} (its -dev package was missing at build time)")
    monkeypatch.setenv(env.AIO_BACKEND, request.param)
    return "kernel"


@pytest.fixture
def engine(backend: str) -> Iterator[AsyncIO]:
    with AsyncIO(SMALL, backend=backend) as io:
        yield io


def _unaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.empty(numel + 1, dtype=dtype)
    if base.data_ptr() % ALIGNMENT:
        return base[:numel]
    return base[1:]  # one element in: not ALIGNMENT-aligned any more


def _random(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8)
    return torch.randn(numel).to(dtype)


# -- aligned_empty ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 1000, 4096, 123457])
def test_aligned_empty(dtype: torch.dtype, numel: int) -> None:
    t = aligned_empty(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % ALIGNMENT == 0
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    assert room >= max(ALIGNMENT, -(-t.nbytes // ALIGNMENT) * ALIGNMENT)


def test_plan_splits_aligned_body_and_buffered_tail() -> None:
    bs = 2 * ALIGNMENT
    # aligned tensor and offset: direct blocks, then the unaligned tail buffered
    assert _plan(0, 5 * ALIGNMENT + 10, ALIGNMENT, True, bs) == [
        (0, bs, ALIGNMENT, 0),
        (bs, bs, ALIGNMENT + bs, 0),
        (2 * bs, ALIGNMENT, ALIGNMENT + 2 * bs, 0),
        (5 * ALIGNMENT, 10, 6 * ALIGNMENT, 2),
    ]
    assert {m for *_, m in _plan(64, 3 * bs, 0, True, bs)} == {1}  # unaligned memory: bounced
    assert {m for *_, m in _plan(0, 3 * bs, 100, True, bs)} == {2}  # unaligned offset: buffered
    assert {m for *_, m in _plan(0, 3 * bs, 0, False, bs)} == {2}  # no O_DIRECT: buffered
    assert _plan(0, 0, 0, True, bs) == []


# -- round trips -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("offset", [0, 3 * ALIGNMENT, 1000], ids=["at0", "aligned_offset", "unaligned_offset"])
def test_round_trip(engine: AsyncIO, tmp_path: Path, dtype: torch.dtype, aligned: bool, offset: int) -> None:
    numel = 5 * SMALL.block_size // torch.empty((), dtype=dtype).element_size() + 77  # not a multiple of anything
    src = aligned_empty(numel, dtype) if aligned else _unaligned(numel, dtype)
    src.copy_(_random(numel, dtype))
    dst = aligned_empty(numel, dtype) if aligned else _unaligned(numel, dtype)
    with engine.open(tmp_path / "swap.bin", create=True) as f:
        engine.write(src, f, offset).wait()
        engine.read(dst, f, offset).wait()
    assert torch.equal(src, dst)
    raw = (tmp_path / "swap.bin").read_bytes()
    assert raw[offset : offset + src.nbytes] == src.view(torch.uint8).numpy().tobytes()


def test_many_requests_beyond_the_queue_depth(backend: str, tmp_path: Path) -> None:
    options = AioOptions(block_size=ALIGNMENT, queue_depth=3, thread_count=2)
    tensors = [_random(ALIGNMENT // 4 * (1 + i % 3) + i, torch.float32) for i in range(40)]
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    with AsyncIO(options, backend=backend) as io, io.open(tmp_path / "many.bin", create=True) as f:
        writes = [io.write(t, f, o) for t, o in zip(tensors, offsets, strict=True)]
        for r in writes:
            r.wait()
        back = [torch.empty_like(t) for t in tensors]
        reads = [io.read(b, f, o) for b, o in zip(back, offsets, strict=True)]
        io.wait_all()
        assert all(r.done() for r in reads)
        assert io.max_in_flight <= 2 * options.queue_depth * options.thread_count
        assert all(n <= options.queue_depth for n in io.device_max_in_flight)
        assert io.in_flight == 0
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("single_submit", [True, False])
def test_queue_depth_one(backend: str, tmp_path: Path, single_submit: bool) -> None:
    options = AioOptions(block_size=ALIGNMENT, queue_depth=1, thread_count=1, single_submit=single_submit)
    x = _random(50_000, torch.float32)
    y = torch.empty_like(x)
    with AsyncIO(options, backend=backend) as io, io.open(tmp_path / "q1.bin", create=True) as f:
        io.write(x, f, 0).wait()
        io.read(y, f, 0).wait()
        assert io.max_in_flight <= 2  # one block at the device, one queued behind it
        assert io.device_max_in_flight == [1]
    assert torch.equal(x, y)


def test_queue_bound_holds_with_many_threads(backend: str, tmp_path: Path) -> None:
    options = AioOptions(block_size=ALIGNMENT, queue_depth=2, thread_count=4)
    x = _random(300_000, torch.float32)
    with AsyncIO(options, backend=backend) as io, io.open(tmp_path / "b.bin", create=True) as f:
        io.write(x, f, 0).wait()
        assert 1 <= io.max_in_flight <= 2 * 2 * 4  # queue_depth per thread at the device, as many queued
        assert all(n <= 2 for n in io.device_max_in_flight)


def test_zero_size_tensor(engine: AsyncIO, tmp_path: Path) -> None:
    with engine.open(tmp_path / "z.bin", create=True) as f:
        request = engine.write(torch.empty(0), f, 0)
        assert request.done()
        request.wait()
        engine.read(torch.empty(0), f, 0).wait()


# -- files -----------------------------------------------------------------------------------------------


def test_direct_io_on_tmp(engine: AsyncIO, tmp_path: Path) -> None:
    with engine.open(tmp_path / "d.bin", create=True) as f:
        assert f.direct == _direct_supported(tmp_path)
        assert f.path == str(tmp_path / "d.bin") and isinstance(f.fd, int)
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT here")


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_tmpfs_falls_back_to_buffered(engine: AsyncIO) -> None:
    path = SHM / f"ds_strategy_aio_test_{os.getpid()}_{engine.backend}.bin"
    try:
        x = _random(30_001, torch.float32)
        y = torch.empty_like(x)
        with engine.open(path, create=True) as f:
            assert f.direct is _direct_supported(SHM)
            engine.write(x, f, ALIGNMENT).wait()
            engine.read(y, f, ALIGNMENT).wait()
        assert torch.equal(x, y)
    finally:
        path.unlink(missing_ok=True)


def test_created_files_are_owner_only(engine: AsyncIO, tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        with engine.open(tmp_path / "new.bin", create=True):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o600
    existing = tmp_path / "existing.bin"
    existing.write_bytes(b"x" * 10)
    existing.chmod(0o644)
    with engine.open(existing, create=True):
        pass
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600
    assert existing.read_bytes() == b"x" * 10  # create never truncates


def test_open_missing_file_without_create(engine: AsyncIO, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        engine.open(tmp_path / "missing.bin")


# -- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 100], ids=["aligned", "unaligned"])
def test_short_read_names_path_offset_and_bytes(engine: AsyncIO, tmp_path: Path, offset: int) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"\1" * 10_000)
    with engine.open(path) as f:
        request = engine.read(aligned_empty(ALIGNMENT * 4, torch.uint8), f, offset)
        with pytest.raises(AioError) as info:
            request.wait()
    err = info.value
    got = 10_000 - offset - SMALL.block_size  # the second block (of two) meets the end of the file
    assert str(err) == (
        f"aio read of {SMALL.block_size} bytes at offset {offset + SMALL.block_size} from {path} failed: "
        f"short read (got {got} bytes)"
    )
    assert err.errno == errno.EIO and err.filename == str(path)
    assert isinstance(err, OSError)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_write_error_names_path_offset_and_errno(backend: str) -> None:
    options = AioOptions(block_size=ALIGNMENT, queue_depth=1, thread_count=1)
    with AsyncIO(options, backend=backend) as io, io.open("/dev/full") as f:
        request = io.write(aligned_empty(2 * ALIGNMENT, torch.uint8).zero_(), f, 0)
        with pytest.raises(AioError) as info:
            request.wait()
        with pytest.raises(AioError):  # a second wait raises the same error again
            request.wait()
    err = info.value
    assert str(err) == (
        f"aio write of {ALIGNMENT} bytes at offset 0 to /dev/full failed: No space left on device (errno 28)"
    )
    assert err.errno == errno.ENOSPC and err.filename == "/dev/full"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_wait_all_and_close_report_unwaited_failures(backend: str) -> None:
    with AsyncIO(backend=backend) as io, io.open("/dev/full") as f:
        io.write(torch.zeros(10), f, 0)
        with pytest.raises(AioError, match="No space left on device"):
            io.wait_all()
        io.wait_all()  # reported once
        io.write(torch.zeros(10), f, 0)
        with pytest.warns(RuntimeWarning, match="a request nobody waited for failed"):
            io.close()


def test_overlap_events_false_raises_from_write(backend: str) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    options = AioOptions(overlap_events=False)
    with AsyncIO(options, backend=backend) as io, io.open("/dev/full") as f, pytest.raises(AioError, match="errno 28"):
        io.write(torch.zeros(10), f, 0)


def test_bad_arguments(engine: AsyncIO, tmp_path: Path) -> None:
    f = engine.open(tmp_path / "a.bin", create=True)
    with pytest.raises(ValueError, match="expected a contiguous CPU tensor"):
        engine.write(torch.zeros(4, 4).t(), f, 0)
    with pytest.raises(ValueError, match="expected a contiguous CPU tensor"):
        engine.read([1, 2], f, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="offset must be a non-negative integer, got -1"):
        engine.write(torch.zeros(4), f, -1)
    f.close()
    f.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        engine.write(torch.zeros(4), f, 0)
    engine.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.write(torch.zeros(4), f, 0)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend must be 'kernel', 'python' or None, got 'uring'"):
        AsyncIO(backend="uring")


def test_default_backend_is_the_kernel_when_it_loads(cpu_kernels: bool) -> None:
    with AsyncIO() as io:
        assert io.backend == "kernel"
        assert io.options == AioOptions()


# -- options ---------------------------------------------------------------------------------------------


def test_options_from_config() -> None:
    """AioOptions takes the values the config validated (tests/config/test_aio.py checks the block)."""
    assert AioOptions.from_config(None) == AioOptions()
    assert AioOptions.from_config({}) == AioOptions()
    config = {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 4,
        "single_submit": True,
        "overlap_events": False,
    }
    assert AioOptions.from_config(config) == AioOptions(262144, 32, 4, True, False)
    validated = AioConfig.from_block({"intra_op_parallelism": 3, "queue_depth": 16, "use_gds": False})
    assert AioOptions.from_config(validated) == AioOptions(queue_depth=16, thread_count=3)
    assert AioOptions.from_config(AioConfig()) == AioOptions()  # the two defaults agree


def test_options_from_an_unvalidated_block_are_refused() -> None:
    """A DeepSpeed dict with its own names is not taken as is: it goes through the config's validation."""
    with pytest.raises(TypeError, match=r"got intra_op_parallelism: pass ds_strategy\.config\.AioConfig\.from_block"):
        AioOptions.from_config({"intra_op_parallelism": 3})


# -- overlap ---------------------------------------------------------------------------------------------

BIG = 64 * 2**20


def test_overlap_events_return_before_completion(backend: str, tmp_path: Path) -> None:
    x = aligned_empty(BIG, torch.uint8).fill_(7)
    options = AioOptions(queue_depth=BIG // AioOptions().block_size)  # every block queued at once
    with AsyncIO(options, backend=backend) as io, io.open(tmp_path / "big.bin", create=True) as f:
        request = io.write(x, f, 0)
        assert not request.done()  # the caller has control back while the write runs
        request.wait()
        assert request.done()


def test_overlap_events_false_completes_before_returning(backend: str, tmp_path: Path) -> None:
    x = aligned_empty(8 * 2**20, torch.uint8).fill_(3)
    y = aligned_empty(x.numel(), torch.uint8)
    with (
        AsyncIO(AioOptions(overlap_events=False), backend=backend) as io,
        io.open(tmp_path / "s.bin", create=True) as f,
    ):
        assert io.write(x, f, 0).done()
        assert io.read(y, f, 0).done()
    assert torch.equal(x, y)


@pytest.mark.serial
def test_waiting_releases_the_gil(backend: str, tmp_path: Path) -> None:
    x = aligned_empty(BIG, torch.uint8).fill_(1)
    options = AioOptions(queue_depth=BIG // AioOptions().block_size)
    with AsyncIO(options, backend=backend) as io, io.open(tmp_path / "gil.bin", create=True) as f:
        during, rate, elapsed = spinner_ticks_during(lambda: io.write(x, f, 0).wait())
    # Held for the whole wait, the spinner would stop: it keeps a good part of its free-running rate.
    assert during > 0.2 * rate * elapsed, (during, rate, elapsed)


def test_concurrent_submitters(backend: str, tmp_path: Path) -> None:
    options = AioOptions(block_size=ALIGNMENT, queue_depth=2, thread_count=2)
    tensors = [_random(20_000, torch.float32) for _ in range(4)]
    slot = 20_480 * 4
    with AsyncIO(options, backend=backend) as io, io.open(tmp_path / "c.bin", create=True) as f:
        threads = [
            threading.Thread(target=lambda i=i: io.write(tensors[i], f, i * slot).wait()) for i in range(len(tensors))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, t in enumerate(tensors):
            back = torch.empty_like(t)
            io.read(back, f, i * slot).wait()
            assert torch.equal(back, t)
