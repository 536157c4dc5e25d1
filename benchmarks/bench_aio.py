"""NVMe offload's I/O engine (ds_strategy.ops.aio) beside DeepSpeed's ``aio_handle`` and ``fio``, at the same
block size and queue depth.

Issue 47: the engine keeps ``queue_depth`` requests in flight per thread (io_uring or Linux AIO). Every case
moves one file of ``--size-mib`` MiB (default 512) in a folder of ``--dir`` (default: the system temp
folder; put it on the disk to measure, ext4 or xfs, not tmpfs: the table names the file system) in 1 MiB
blocks from one I/O thread, at queue depth 1, 8 and 32:

- ours: ``AsyncIO`` (O_DIRECT, an aligned tensor) with each I/O backend the C++ engine was built with,
  forced through ``DS_STRATEGY_AIO_BACKEND``: io_uring, libaio, and blocking (pread/pwrite, one request
  at a time: the engine before issue 47);
- DeepSpeed: ``AsyncIOBuilder().load().aio_handle(block_size, queue_depth, single_submit=False,
  overlap_events=True, intra_op_parallelism=1)``, ``sync_pwrite`` / ``sync_pread`` of the same aligned
  tensor (libaio, O_DIRECT), when deepspeed imports and its op builds (it needs libaio-dev);
- fio (Debian's package), ``--ioengine=libaio`` and ``io_uring``, ``--direct=1``, same block size, size and
  ``--iodepth``, one job: its own bandwidth figure;
- a plain sequential reference: ``os.write`` of 1 MiB chunks then ``fsync``, ``os.readv`` after eviction.

Each case writes the file twice, both ending with ``fsync`` (fio: ``--end_fsync=1``): into a new file (the
first swap-out: the file system allocates as it goes, and ext4 serialises O_DIRECT writes that extend a
file) and over the file just written (every later swap-out rewrites the same regions). Reads start with
the file evicted from the page cache (``fsync``, then ``posix_fadvise(POSIX_FADV_DONTNEED)``; fio also
invalidates), so they come from the device, not RAM. Rounds are interleaved (every case once per round, after a warm-up
round) so load from other jobs hits all alike; the table shows the median over rounds in GB/s (10^9
bytes/s). Every read by ours and DeepSpeed is checked against the bytes written; for ours the JSON also
records the most transfers each worker had outstanding at the device (``device_max_in_flight``).

    python -m benchmarks.run_all aio          # or: python -m benchmarks.bench_aio [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.common import machine, markdown_table, results_dir, write_results
from ds_strategy import env
from ds_strategy.ops.aio import AioOptions, AsyncIO, aligned_empty, compiled_backends

BLOCK = 2**20  # bytes per request, every engine
DEPTHS = (1, 8, 32)
QUICK_DEPTHS = (1, 8)


def _filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (longest mount point prefix in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the engines: each case writes a fresh file, then reads it back evicted; returns (write s, read s) ----


class _Case:
    def __init__(self, engine: str, io: str, depth: int | None) -> None:
        self.engine, self.io, self.depth = engine, io, depth
        self.write_s: list[float] = []  # into a new file
        self.overwrite_s: list[float] = []
        self.read_s: list[float] = []
        self.extra: dict[str, Any] = {}

    @property
    def label(self) -> str:
        return f"{self.engine} ({self.io})" if self.io != "-" else self.engine

    def run(self, path: Path, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, float]:
        """Write ``src`` into the new file ``path``, write it again over it, read it into ``dst`` evicted:
        the three times in seconds."""
        raise NotImplementedError


class _Plain(_Case):
    def run(self, path: Path, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, float]:
        data, out = memoryview(src.numpy()), memoryview(dst.numpy())

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for start in range(0, len(data), BLOCK):
                    view = data[start : start + BLOCK]
                    while view:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)

        def read() -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                at = 0
                while at < len(out):
                    n = os.readv(fd, [out[at : at + BLOCK]])
                    if n == 0:
                        raise OSError(f"{path}: short read at {at}")
                    at += n
            finally:
                os.close(fd)

        w, over = _timed(write), _timed(write)
        _evict(path)
        return w, over, _timed(read)


class _Ours(_Case):
    def run(self, path: Path, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, float]:
        options = AioOptions(block_size=BLOCK, queue_depth=self.depth or 1, thread_count=1)
        with mock.patch.dict(os.environ, {env.AIO_BACKEND: self.io}), AsyncIO(options, backend="kernel") as io:
            assert io.io_backend == self.io, (io.io_backend, self.io)
            with io.open(path, create=True) as f:
                self.extra["direct"] = f.direct

                def write() -> None:
                    io.write(src, f, 0).wait()
                    os.fsync(f.fd)

                w, over = _timed(write), _timed(write)
            _evict(path)
            with io.open(path) as f:
                r = _timed(lambda: io.read(dst, f, 0).wait())
            self.extra["device_max_in_flight"] = max(io.device_max_in_flight)
        return w, over, r


class _DeepSpeed(_Case):
    def __init__(self, module: Any, depth: int) -> None:
        super().__init__("DeepSpeed aio_handle", "libaio", depth)
        self.handle = module.aio_handle(BLOCK, depth, False, True, 1)

    def run(self, path: Path, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, float]:
        def write() -> None:
            self.handle.sync_pwrite(src, str(path))
            _fsync(path)

        w, over = _timed(write), _timed(write)
        _evict(path)
        return w, over, _timed(lambda: self.handle.sync_pread(dst, str(path)))


class _Fio(_Case):
    def __init__(self, ioengine: str, depth: int, nbytes: int) -> None:
        super().__init__("fio", ioengine, depth)
        self.nbytes = nbytes

    def _job(self, path: Path, rw: str) -> float:
        cmd = [
            "fio", "--name=bench", f"--filename={path}", f"--rw={rw}", f"--bs={BLOCK}", f"--size={self.nbytes}",
            f"--ioengine={self.io}", f"--iodepth={self.depth}", "--direct=1", "--numjobs=1", "--fallocate=none",
            "--output-format=json", *(["--end_fsync=1"] if rw == "write" else []),
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        job = json.loads(out[out.index("{") :])["jobs"][0][rw]
        if job["io_bytes"] != self.nbytes:
            raise RuntimeError(f"fio moved {job['io_bytes']} bytes, not {self.nbytes}")
        return self.nbytes / job["bw_bytes"]

    def run(self, path: Path, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, float]:
        w, over = self._job(path, "write"), self._job(path, "write")
        _evict(path)
        r = self._job(path, "read")
        dst.copy_(src)  # fio writes its own pattern: nothing of ours to check
        return w, over, r


def _deepspeed_aio() -> tuple[Any, str]:
    """DeepSpeed's async_io module (JIT-built on first use, cached), or None and why not."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "DeepSpeed's async_io op is not compatible here (libaio-dev missing?)"
        return builder.load(verbose=False), ""
    except Exception as err:
        return None, f"{type(err).__name__}: {err}".splitlines()[0][:300] + "\n" + traceback.format_exc(limit=2)[-300:]


def _cases(depths: tuple[int, ...], nbytes: int) -> tuple[list[_Case], dict[str, str]]:
    skipped: dict[str, str] = {}
    ours = compiled_backends()
    ds, ds_error = _deepspeed_aio()
    if ds is None:
        skipped["DeepSpeed aio_handle"] = ds_error
    fio = shutil.which("fio")
    if fio is None:
        skipped["fio"] = "the fio binary is not installed (apt-get install fio)"
    cases: list[_Case] = [_Plain("plain sequential", "-", None)]
    for depth in depths:
        cases += [_Ours("ours", io, depth) for io in ours]
        if ds is not None:
            cases.append(_DeepSpeed(ds, depth))
        if fio is not None:
            cases += [_Fio(ioengine, depth, nbytes) for ioengine in ("libaio", "io_uring")]
    return cases, skipped


def measure(size_mib: int, rounds: int, work: Path, depths: tuple[int, ...]) -> dict[str, Any]:
    nbytes = size_mib * 2**20
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src, dst = aligned_empty(nbytes, torch.uint8).copy_(data), aligned_empty(nbytes, torch.uint8)
    cases, skipped = _cases(depths, nbytes)
    path = work / "aio.bin"
    for i in range(rounds + 1):  # round 0: warm-up (file system, thread start-up, fio's first run), not recorded
        for case in cases:
            path.unlink(missing_ok=True)
            dst.zero_()
            w, over, r = case.run(path, src, dst)
            if not torch.equal(src, dst):
                raise AssertionError(f"{case.label}, qd {case.depth}: the bytes read back differ from those written")
            if i > 0:
                case.write_s.append(w)
                case.overwrite_s.append(over)
                case.read_s.append(r)
        print(f"round {i}/{rounds} done", flush=True)
    path.unlink(missing_ok=True)
    records = [
        {
            "engine": case.engine,
            "io": case.io,
            "depth": case.depth,
            "write_s": case.write_s,
            "overwrite_s": case.overwrite_s,
            "read_s": case.read_s,
            "write_gbps": nbytes / statistics.median(case.write_s) / 1e9,
            "overwrite_gbps": nbytes / statistics.median(case.overwrite_s) / 1e9,
            "read_gbps": nbytes / statistics.median(case.read_s) / 1e9,
            **case.extra,
        }
        for case in cases
    ]
    return {"bytes": nbytes, "block_size": BLOCK, "rounds": rounds, "depths": list(depths), "cases": records,
            "skipped": skipped}  # fmt: skip


KINDS = (("read_gbps", "read"), ("overwrite_gbps", "overwrite"), ("write_gbps", "new file"))


def _table(payload: dict[str, Any]) -> str:
    """One row per engine: read, overwrite and new-file write GB/s at each depth."""
    depths = payload["depths"]
    columns = ["engine", *[f"{kind} qd {d}" for _, kind in KINDS for d in depths]]
    plain = next(r for r in payload["cases"] if r["engine"] == "plain sequential")
    rows = [["plain sequential (buffered, reference)", *[f"{plain[key]:.2f}" for key, _ in KINDS for _ in depths]]]
    labels = dict.fromkeys((r["engine"], r["io"]) for r in payload["cases"] if r["depth"] is not None)
    for engine, io in labels:
        by_depth = {r["depth"]: r for r in payload["cases"] if (r["engine"], r["io"]) == (engine, io)}
        rows.append([f"{engine} ({io})", *[f"{by_depth[d][key]:.2f}" for key, _ in KINDS for d in depths]])
    return markdown_table(columns, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB, queue depth 1 and 8, 1 round (smoke run)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the test file (its file system)")
    parser.add_argument("--size-mib", type=int, default=None, help="file size in MiB (default 512)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    args = parser.parse_args(argv)
    size = args.size_mib or (16 if args.quick else 512)
    rounds = args.rounds or (1 if args.quick else 3)
    depths = QUICK_DEPTHS if args.quick else DEPTHS
    with tempfile.TemporaryDirectory(prefix="bench_aio_", dir=args.dir) as tmp:
        work = Path(tmp)
        fs = _filesystem(work.resolve())
        result = measure(size, rounds, work, depths)
    payload = {"machine": machine(), "dir": str(Path(args.dir).resolve()), "filesystem": fs, **result}
    ours_depth = {
        f"{r['io']} qd {r['depth']}": r["device_max_in_flight"] for r in payload["cases"] if r["engine"] == "ours"
    }
    note = (
        f"\n\nGB/s (10^9 bytes/s), median of {rounds} interleaved rounds after a warm-up round: a {size} MiB file "
        f"in {payload['dir']} ({fs}), {BLOCK // 2**20} MiB blocks, one I/O thread, O_DIRECT for every engine "
        "but the plain reference. 'new file': writes into a new file; 'overwrite': the same bytes written again "
        "over it (the steady state of swap files); both include fsync (fio: end_fsync=1). Reads start with the "
        "file evicted from the page cache. 'ours (blocking)' is the pread/pwrite path (one request in "
        "flight, the engine before issue 47). Most transfers ours had outstanding at the device per thread: "
        + ", ".join(f"{k}: {v}" for k, v in ours_depth.items())
        + ". Timed on a shared machine (other jobs running): read trends, not absolutes."
    )
    if payload["skipped"]:
        note += " Not measured: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in payload["skipped"].items()) + "."
    table = _table(payload)
    write_results("aio", payload, table + note)
    _plot(payload)
    print(table + note)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md: at each depth, our best backend beside
    DeepSpeed's aio_handle and fio (libaio), read, overwrite and new-file write GB/s."""
    cases = payload["cases"]
    plain = next(r for r in cases if r["engine"] == "plain sequential")
    size = f"{payload['bytes'] // 2**20} MiB on {payload.get('filesystem', '?')}"
    out = [(f"plain sequential, {size}", ", ".join(f"{kind} {plain[key]:.2f}" for key, kind in KINDS) + " GB/s")]
    for depth in payload["depths"]:
        mine = [r for r in cases if r["engine"] == "ours" and r["depth"] == depth]
        peers = [r for r in cases if r["engine"] != "ours" and r["depth"] == depth and r["io"] == "libaio"]
        best = {key: max(mine, key=lambda r, key=key: r[key]) for key, _ in KINDS}
        figures = ["ours " + ", ".join(f"{kind} {best[key][key]:.2f} ({best[key]['io']})" for key, kind in KINDS)]
        figures += [f"{r['engine']} " + ", ".join(f"{kind} {r[key]:.2f}" for key, kind in KINDS) for r in peers]
        out.append((f"qd {depth}, 1 MiB blocks, GB/s", "; ".join(figures)))
    return out


def _plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = payload["depths"]
    engines = list(dict.fromkeys((r["engine"], r["io"]) for r in payload["cases"] if r["depth"] is not None))
    plain = next(r for r in payload["cases"] if r["engine"] == "plain sequential")
    fig, axes = plt.subplots(1, len(KINDS), figsize=(18, 5.5))
    width = 0.8 / max(len(engines), 1)
    for ax, (key, kind) in zip(axes, KINDS, strict=True):
        title = f"{kind} GB/s"
        for k, (engine, io) in enumerate(engines):
            by_depth = {r["depth"]: r[key] for r in payload["cases"] if (r["engine"], r["io"]) == (engine, io)}
            xs = [i + (k - (len(engines) - 1) / 2) * width for i in range(len(depths))]
            ax.bar(xs, [by_depth[d] for d in depths], width, label=f"{engine} ({io})")
        ax.axhline(plain[key], color="tab:gray", linestyle="--", linewidth=1, label="plain sequential (buffered)")
        ax.set_xticks(range(len(depths)), [f"qd {d}" for d in depths])
        ax.set_ylabel(title)
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
    fig.suptitle(
        f"{payload['bytes'] // 2**20} MiB, {payload['block_size'] // 2**20} MiB blocks, one thread, "
        f"on {payload.get('filesystem', '?')} ({payload['dir']})"
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))  # room for the legend below the panels
    fig.savefig(results_dir() / "aio.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
