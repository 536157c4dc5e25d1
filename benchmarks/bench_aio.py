"""Asynchronous file I/O (ds_strategy.ops.aio, the engine under NVMe offload) beside a plain sequential
read / write of the same bytes on the same file system.

Issue 22's target: the engine's bandwidth at >= 80% of the plain sequential one. Every case moves one
file of ``--size-mib`` MiB (default 512) in a folder of ``--dir`` (default: the system temp folder):

- plain write: ``os.write`` of 1 MiB chunks into a fresh (truncated) buffered file, then ``fsync``; the
  time includes the fsync, so the data is on the device as with O_DIRECT.
- plain read: ``os.readv`` of 1 MiB chunks into one preallocated buffer, after the file was evicted from
  the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` after its fsync): read from the device, not RAM.
- engine write / read: one ``AsyncIO.write`` / ``read`` of an aligned tensor (:func:`aligned_empty`)
  into a fresh file, waited for; the write is followed by ``fsync`` too, the read by nothing (O_DIRECT
  when the file system allows it: no page cache; evicted beforehand all the same). Each setting runs on
  both backends (``kernel``: the C++ thread pool, ``python``: ThreadPoolExecutor + os.pread/pwrite), plus
  one case with an unaligned tensor (every block bounces through the staging buffer).

Rounds are interleaved (every case once per round) so load from other jobs hits all alike; the table
shows the median over rounds in GB/s (10^9 bytes/s) and the ratio to the plain median. Every read is
checked against the bytes written.

    python -m benchmarks.run_all aio          # or: python -m benchmarks.bench_aio [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, markdown_table, results_dir, write_results
from ds_strategy.ops.aio import AioOptions, AsyncIO, aligned_empty
from ds_strategy.ops.builder import load_cpu_kernels

CHUNK = 2**20  # the plain loops' transfer size
SETTINGS = {  # label -> options
    "DeepSpeed defaults (1 MiB blocks, qd 8, 1 thread)": AioOptions(),
    "1 MiB blocks, qd 16, 2 threads": AioOptions(queue_depth=16, thread_count=2),
    "8 MiB blocks, qd 8, 4 threads": AioOptions(block_size=8 * 2**20, queue_depth=8, thread_count=4),
}


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


def _plain_write(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for start in range(0, len(data), CHUNK):
            view = data[start : start + CHUNK]
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_read(path: Path, out: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        at = 0
        while at < len(out):
            n = os.readv(fd, [out[at : at + CHUNK]])
            if n == 0:
                raise OSError(f"{path}: short read at {at}")
            at += n
    finally:
        os.close(fd)


class _Case:
    def __init__(self, label: str, options: AioOptions | None, backend: str | None, aligned: bool = True) -> None:
        self.label, self.options, self.backend, self.aligned = label, options, backend, aligned
        self.write_s: list[float] = []
        self.read_s: list[float] = []
        self.direct: bool | None = None


def _buffers(numel: int, aligned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if aligned:
        return aligned_empty(numel, torch.uint8), aligned_empty(numel, torch.uint8)
    src, dst = torch.empty(numel + 64, dtype=torch.uint8), torch.empty(numel + 64, dtype=torch.uint8)
    return src[1 : numel + 1], dst[3 : numel + 3]  # not 4096-aligned: every block bounces


def _run_case(case: _Case, data: torch.Tensor, work: Path) -> bool:
    """One write + read round of ``case``; returns whether the read gave back the bytes written."""
    path = work / "aio.bin"
    path.unlink(missing_ok=True)
    src, dst = _buffers(data.numel(), case.aligned)
    src.copy_(data)
    dst.zero_()
    if case.options is None:  # plain
        start = time.perf_counter()
        _plain_write(path, memoryview(src.numpy()))
        case.write_s.append(time.perf_counter() - start)
        _evict(path)
        start = time.perf_counter()
        _plain_read(path, memoryview(dst.numpy()))
        case.read_s.append(time.perf_counter() - start)
    else:
        with AsyncIO(case.options, backend=case.backend) as io:
            with io.open(path, create=True) as f:
                case.direct = f.direct
                start = time.perf_counter()
                io.write(src, f, 0).wait()
                os.fsync(f.fd)
                case.write_s.append(time.perf_counter() - start)
            _evict(path)
            with io.open(path) as f:
                start = time.perf_counter()
                io.read(dst, f, 0).wait()
                case.read_s.append(time.perf_counter() - start)
    path.unlink(missing_ok=True)
    return bool(torch.equal(src, dst))


def _cases(backends: list[str]) -> list[_Case]:
    cases = [_Case("plain sequential (os.write + fsync / os.readv, 1 MiB)", None, None)]
    for label, options in SETTINGS.items():
        cases += [_Case(f"{backend}: {label}", options, backend) for backend in backends]
    if "kernel" in backends:
        label = f"kernel: unaligned tensor (bounced), {next(iter(SETTINGS))}"
        cases.append(_Case(label, AioOptions(), "kernel", aligned=False))
    return cases


def measure(size_mib: int, rounds: int, work: Path, backends: list[str]) -> dict[str, Any]:
    numel = size_mib * 2**20
    data = torch.arange(numel, dtype=torch.int64).mul_(2654435761).to(torch.uint8)  # not compressible to zeros
    cases = _cases(backends)
    runners: dict[str, Callable[[], bool]] = {c.label: (lambda c=c: _run_case(c, data, work)) for c in cases}
    for i in range(rounds + 1):  # round 0: warm-up (file system, thread start-up), not recorded
        for case in cases:
            ok = runners[case.label]()
            if not ok:
                raise AssertionError(f"{case.label}: the bytes read back differ from the bytes written")
            if i == 0:
                case.write_s.clear()
                case.read_s.clear()
        print(f"round {i}/{rounds} done", flush=True)
    nbytes = numel
    plain = cases[0]
    plain_w = nbytes / statistics.median(plain.write_s) / 1e9
    plain_r = nbytes / statistics.median(plain.read_s) / 1e9
    records = []
    for case in cases:
        w = nbytes / statistics.median(case.write_s) / 1e9
        r = nbytes / statistics.median(case.read_s) / 1e9
        records.append(
            {
                "case": case.label,
                "backend": case.backend or "plain",
                "options": None if case.options is None else asdict(case.options),
                "aligned": case.aligned,
                "direct": case.direct,
                "write_s": case.write_s,
                "read_s": case.read_s,
                "write_gbps": w,
                "read_gbps": r,
                "write_ratio": w / plain_w,
                "read_ratio": r / plain_r,
            }
        )
    return {"bytes": nbytes, "rounds": rounds, "cases": records}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 round (smoke run)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the test file (its file system)")
    parser.add_argument("--size-mib", type=int, default=None, help="file size in MiB (default 512)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    args = parser.parse_args(argv)
    size = args.size_mib or (16 if args.quick else 512)
    rounds = args.rounds or (1 if args.quick else 3)
    backends = (["kernel"] if load_cpu_kernels() else []) + ["python"]
    with tempfile.TemporaryDirectory(prefix="bench_aio_", dir=args.dir) as tmp:
        work = Path(tmp)
        fs = _filesystem(work.resolve())
        result = measure(size, rounds, work, backends)
    payload = {"machine": machine(), "dir": str(Path(args.dir).resolve()), "filesystem": fs, **result}
    rows = [
        (
            r["case"],
            "-" if r["direct"] is None else ("yes" if r["direct"] else "no"),
            f"{r['write_gbps']:.2f}",
            f"{r['write_ratio']:.2f}",
            f"{r['read_gbps']:.2f}",
            f"{r['read_ratio']:.2f}",
        )
        for r in payload["cases"]
    ]
    columns = ("case", "O_DIRECT", "write GB/s", "write vs plain", "read GB/s", "read vs plain")
    note = (
        f"\n\n{size} MiB file in {payload['dir']} ({fs}); median of {rounds} interleaved rounds after a warm-up "
        "round. GB/s = 10^9 bytes/s. Writes include fsync (plain: buffered writes then fsync; engine: "
        "O_DIRECT where the file system allows, then fsync). Reads start with the file evicted from the page "
        "cache (posix_fadvise DONTNEED after fsync), so the plain read comes from the device, not RAM. "
        "'vs plain' = engine / plain sequential (issue 22's target: >= 0.80). Every read is checked against "
        "the bytes written. Timed on a shared machine (other jobs running): read trends, not absolutes."
    )
    table = markdown_table(columns, rows)
    write_results("aio", payload, table + note)
    _plot(payload)
    print(table + note)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md: each backend's best setting and the
    DeepSpeed-default setting, as ratios to the plain sequential read / write."""
    out = []
    engine = [r for r in payload["cases"] if r["backend"] != "plain" and r["aligned"]]
    plain = next(r for r in payload["cases"] if r["backend"] == "plain")
    out.append(
        (
            f"plain sequential, {payload['bytes'] // 2**20} MiB on {payload.get('filesystem', '?')}",
            f"write {plain['write_gbps']:.2f} GB/s, read {plain['read_gbps']:.2f} GB/s",
        )
    )
    for backend in sorted({r["backend"] for r in engine}):
        mine = [r for r in engine if r["backend"] == backend]
        default = next((r for r in mine if "DeepSpeed defaults" in r["case"]), None)
        if default is not None:
            out.append(
                (
                    f"{backend} backend, DeepSpeed default aio settings vs plain",
                    f"write {default['write_ratio']:.2f}x, read {default['read_ratio']:.2f}x",
                )
            )
        best_w = max(mine, key=lambda r: r["write_gbps"])
        best_r = max(mine, key=lambda r: r["read_gbps"])
        out.append(
            (
                f"{backend} backend, best setting vs plain",
                f"write {best_w['write_ratio']:.2f}x ({best_w['write_gbps']:.2f} GB/s), "
                f"read {best_r['read_ratio']:.2f}x ({best_r['read_gbps']:.2f} GB/s)",
            )
        )
    return out


def _plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = payload["cases"]
    labels = [c["case"] for c in cases]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.5 * len(cases) + 1.5), sharey=True)
    for ax, key, title, color in zip(
        axes, ("write_gbps", "read_gbps"), ("write GB/s", "read GB/s"), ("tab:blue", "tab:green"), strict=True
    ):
        values = [c[key] for c in cases]
        ax.barh(labels, values, color=[("tab:gray" if c["backend"] == "plain" else color) for c in cases])
        ax.axvline(0.8 * values[0], color="tab:red", linestyle="--", linewidth=1, label="80% of plain")
        ax.set_xlabel(title)
        ax.legend(loc="lower right", fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{payload['bytes'] // 2**20} MiB on {payload.get('filesystem', '?')} ({payload['dir']})")
    fig.tight_layout()
    fig.savefig(results_dir() / "aio.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
