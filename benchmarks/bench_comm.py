"""Single-node CPU collectives on 2 ranks: our shared-memory kernel beside gloo and DeepSpeed's shm
all-reduce, at 1 MB, 16 MB and 128 MB, with each algorithm's memory-traffic bound.
Writes benchmarks/results/comm.{json,md,png}.

    python -m benchmarks.run_all comm            # or: python -m benchmarks.bench_comm [--quick]

Sizes follow nccl-tests: all_reduce S = the tensor, reduce_scatter S = the (full) input, all_gather S = the
(full) output, bytes per rank. algbw = S / t; busbw = algbw * 2(W-1)/W (all_reduce) or (W-1)/W (the other
two), the bytes each rank must move over the "wire" per second whatever the algorithm.

Memory-traffic bound: each algorithm reads and writes a known number of bytes per rank (listed in TRAFFIC).
The measured copy bandwidth C (every rank copying a 256 MB buffer at once, bytes copied per second summed
over ranks) moves 2 C bytes of traffic (a read and a write per byte copied), so an algorithm can't finish
faster than t_min = sum over ranks of its traffic / (2 C). At 1 MB everything lives in cache and the
bound is not the limit (barrier latency is); from 16 MB up it is the physical limit on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import machine, markdown_table, results_dir, run_ranks, write_results

WORLD = 2
SIZES_MB = (1, 16, 128)
OPS = ("all_reduce", "reduce_scatter", "all_gather")
MB = 1 << 20


def traffic_per_rank(op: str, size: int, world: int, small_bytes: int) -> float:
    """Bytes read + written per rank by our algorithm for one call of `op` on S = `size` bytes."""
    w = world
    if op == "all_reduce" and size <= small_bytes:
        return 2 * size + (w + 1) * size  # copy in; read every slot, write the result
    if op == "all_reduce":
        # copy W-1 slices in; read W slices of S/W, write result to tensor and slot; copy W-1 slices out
        return 2 * (w - 1) / w * size + size + 2 * size / w + 2 * (w - 1) / w * size
    if op == "reduce_scatter":
        return 2 * (w - 1) / w * size + size + size / w  # copy W-1 pieces in; read W pieces, write 1
    return 2 * size / w + 2 * size / w + 2 * (w - 1) / w * size  # own piece to slot and output; W-1 out


def floor_per_rank(op: str, size: int, world: int) -> float:
    """Bytes every algorithm must read + write per rank: its input once and its output once (the
    shared-memory slots can stay in cache when chunks are small; the user's buffers cannot)."""
    if op == "all_reduce":
        return 2 * size
    return size + size / world  # reduce_scatter: read S, write S/W; all_gather: read S/W, write S


TRAFFIC = {
    "all_reduce": "small: 2S + (W+1)S; large: 4(W-1)/W S + S + 2S/W  (W=2: 4S)",
    "reduce_scatter": "2(W-1)/W S + S + S/W  (W=2: 2.5S)",
    "all_gather": "4S/W + 2(W-1)/W S  (W=2: 3S)",
}


def bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _iters(size: int, quick: bool) -> int:
    return max(1 if quick else 3, min(400, int((16 if quick else 256) * MB / max(size, 1))))


def _time_interleaved(impls: dict[str, Callable[[], Any]], size: int, quick: bool) -> dict[str, float]:
    """Seconds per call on this rank for each implementation: warm up, then rounds that time a batch of
    each implementation in turn (so that load from other processes on this shared machine hits them
    alike), keeping each one's best batch. Ranks start every batch together after a gloo barrier."""
    iters = _iters(size, quick)
    for fn in impls.values():
        for _ in range(2):
            fn()
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(2 if quick else 7):
        for name, fn in impls.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / iters)
    return best


def _copy_bandwidth(quick: bool) -> float:
    """Bytes copied per second by this rank while every rank copies at once."""
    n = (16 if quick else 256) * MB
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return n / _time_interleaved({"copy": lambda: dst.copy_(src)}, n, quick)["copy"]


def _deepspeed_all_reduce(rank: int, world: int) -> tuple[Callable[[torch.Tensor], Any] | None, str]:
    """DeepSpeed's CPU shm all-reduce as its CPU accelerator uses it: deepspeed.comm on the existing gloo
    group, then deepspeed.comm.inference_all_reduce -> torch.ops.deepspeed.inference_all_reduce_."""
    os.environ["LOCAL_SIZE"] = str(world)  # DeepSpeed's shm op only engages when LOCAL_SIZE == world size
    try:
        import deepspeed
        import deepspeed.comm as ds_comm

        ds_comm.init_distributed(dist_backend="gloo", verbose=False)
        if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
            return None, "deepspeed's shm op did not load (torch.ops.deepspeed.inference_all_reduce_ missing)"
        backend = ds_comm.comm.cdb
        level = getattr(backend, "shm_vector_kernel_level", None)
        version = f"deepspeed {deepspeed.__version__}, shm kernel level {level}"
        return (lambda t: ds_comm.inference_all_reduce(t)), version
    except Exception as err:  # recorded in the results instead
        return None, f"deepspeed unavailable: {type(err).__name__}: {err}"


def _implementations(
    op: str, comm: Any, ds_fn: Callable[[torch.Tensor], Any] | None, x: torch.Tensor, shard: torch.Tensor,
    full: torch.Tensor, piece: torch.Tensor,
) -> dict[str, Callable[[], Any]]:  # fmt: skip
    if op == "all_reduce":
        impls = {"ours": lambda: comm.all_reduce(x), "gloo": lambda: dist.all_reduce(x)}
        if ds_fn is not None:
            impls["deepspeed"] = lambda: ds_fn(x)
        return impls
    if op == "reduce_scatter":
        return {"ours": lambda: comm.reduce_scatter(shard, x), "gloo": lambda: dist.reduce_scatter_tensor(shard, x)}
    return {"ours": lambda: comm.all_gather(full, piece), "gloo": lambda: dist.all_gather_into_tensor(full, piece)}


def _rank(rank: int, world: int, quick: bool) -> dict[str, Any]:
    from ds_strategy.comm.shm import DEFAULT_SMALL_BYTES, SMALL_BYTES_ENV, ShmCommunicator

    comm = ShmCommunicator.create(timeout=300)
    assert comm is not None, "the CPU kernels must build for this benchmark"
    small_bytes = int(os.environ.get(SMALL_BYTES_ENV) or DEFAULT_SMALL_BYTES)
    out: dict[str, Any] = {"copy_bandwidth": _copy_bandwidth(quick), "times": {}, "small_bytes": small_bytes}
    ds_fn, ds_note = _deepspeed_all_reduce(rank, world)
    out["deepspeed"] = ds_note
    for op in OPS:
        for mb in SIZES_MB:
            size = mb * MB
            n = size // 4
            x = torch.randn(n)
            shard = torch.empty(n // world)
            full = torch.empty(n)
            piece = torch.randn(n // world)
            impls = _implementations(op, comm, ds_fn, x, shard, full, piece)
            for name, seconds in _time_interleaved(impls, size, quick).items():
                out["times"][f"{op}/{mb}/{name}"] = seconds
    comm.close()
    return out


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md: our speed-up over gloo (and DeepSpeed's shm
    all-reduce where it ran) per op and size."""
    by = {(r["op"], r["MB"], r["impl"]): r["ms"] for r in payload["rows"]}
    out = []
    for op in OPS:
        for mb in SIZES_MB:
            ours = by.get((op, mb, "ours"))
            if ours is None:
                continue
            peers = [
                f"{impl} {by[(op, mb, impl)] / ours:.2f}x" for impl in ("gloo", "deepspeed") if (op, mb, impl) in by
            ]
            out.append((f"{op} {mb} MB: speed-up vs", ", ".join(peers)))
    return out


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(15, 4.5))
    impls = ("ours", "gloo", "deepspeed")
    colors = {"ours": "tab:blue", "gloo": "tab:gray", "deepspeed": "tab:orange"}
    for ax, op in zip(axes, OPS, strict=True):
        for i, impl in enumerate(impls):
            xs, ys = [], []
            for j, mb in enumerate(SIZES_MB):
                row = next((r for r in rows if r["op"] == op and r["MB"] == mb and r["impl"] == impl), None)
                if row is not None:
                    xs.append(j + (i - 1) * 0.27)
                    ys.append(row["busbw_GBps"])
            if xs:
                ax.bar(xs, ys, width=0.27, label=impl, color=colors[impl])
        bounds = [next(r for r in rows if r["op"] == op and r["MB"] == mb and r["impl"] == "ours") for mb in SIZES_MB]
        ax.plot(range(len(SIZES_MB)), [b["floor_busbw_GBps"] for b in bounds], "k-", marker="_", ms=20,
                label="floor: input read + output written once")  # fmt: skip
        ax.plot(range(len(SIZES_MB)), [b["bound_busbw_GBps"] for b in bounds], "k--", marker="_", ms=20,
                label="all-pass bound (ours, nothing cached)")  # fmt: skip
        ax.set_xticks(range(len(SIZES_MB)), [f"{mb} MB" for mb in SIZES_MB])
        ax.set_title(op)
        ax.set_ylabel("bus bandwidth, GB/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"CPU collectives, {WORLD} ranks on one node (shared 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args(argv)
    shm_before = set(os.listdir("/dev/shm"))
    per_rank = run_ranks(_rank, WORLD, args.quick)
    # Segment hygiene, ours and DeepSpeed's: our names must be gone; DeepSpeed's shm op never unlinks its
    # per-rank buffers, so remove the ones this run created.
    new = set(os.listdir("/dev/shm")) - shm_before
    ours_left = sorted(n for n in new if n.startswith("ds_strategy_shm."))
    deepspeed_left = sorted(n for n in new if n.startswith("deepspeed_allreduce_buffer"))
    for name in deepspeed_left:
        os.unlink(f"/dev/shm/{name}")
    copy_bw = sum(r["copy_bandwidth"] for r in per_rank)  # aggregate bytes copied per second
    small_bytes = per_rank[0]["small_bytes"]
    rows: list[dict[str, Any]] = []
    for key in per_rank[0]["times"]:
        op, mb_text, impl = key.split("/")
        mb = int(mb_text)
        size = mb * MB
        seconds = max(r["times"][key] for r in per_rank)  # a collective ends when its slowest rank does
        algbw = size / seconds / 1e9
        t_min = WORLD * traffic_per_rank(op, size, WORLD, small_bytes) / (2 * copy_bw)
        t_floor = WORLD * floor_per_rank(op, size, WORLD) / (2 * copy_bw)
        rows.append(
            {
                "op": op, "MB": mb, "impl": impl, "ms": seconds * 1e3, "algbw_GBps": algbw,
                "busbw_GBps": algbw * bus_factor(op, WORLD), "bound_ms": t_min * 1e3, "floor_ms": t_floor * 1e3,
                "floor_busbw_GBps": size / t_floor / 1e9 * bus_factor(op, WORLD),
                "bound_busbw_GBps": size / t_min / 1e9 * bus_factor(op, WORLD),
            }
        )  # fmt: skip
    by = {(r["op"], r["MB"], r["impl"]): r for r in rows}
    table_rows = []
    for r in rows:
        gloo = by[(r["op"], r["MB"], "gloo")]["ms"]
        ds = by.get((r["op"], r["MB"], "deepspeed"))
        table_rows.append(
            [
                r["op"], f"{r['MB']} MB", r["impl"], f"{r['ms']:.3f}", f"{r['algbw_GBps']:.2f}",
                f"{r['busbw_GBps']:.2f}",
                f"{gloo / r['ms']:.1f}x", f"{ds['ms'] / r['ms']:.2f}x" if ds else "-",
                f"{r['floor_ms']:.3f}", f"{r['bound_ms']:.3f}" if r["impl"] == "ours" else "-",
            ]
        )  # fmt: skip
    cols = ["op", "size", "impl", "ms", "algbw GB/s", "busbw GB/s", "vs gloo", "vs DeepSpeed"]
    cols += ["floor ms", "all-pass ms"]
    header = (
        f"CPU collectives, {WORLD} ranks, one process per core, timings on a shared 2-core machine "
        f"({machine()['cpu']}, torch {torch.__version__}); best of 7 interleaved batches, slowest rank.\n\n"
        f"Measured memory copy bandwidth (both ranks copying 256 MB at once): {copy_bw / 1e9:.1f} GB/s.\n"
        f"DeepSpeed: {per_rank[0]['deepspeed']}.\n"
        f"Left in /dev/shm after the run: ours {len(ours_left)}, DeepSpeed's {len(deepspeed_left)} (removed).\n\n"
        "Memory-traffic bounds at the measured copy bandwidth (a copy = one read + one write per byte): "
        "`floor ms` = reading the input and writing the output once (what any algorithm must move; the "
        "physical limit when the shared slots stay in cache), `all-pass ms` = our algorithm's every read and "
        "write going to memory (the limit if nothing stayed in cache). Our traffic per rank (reads + writes, "
        "S bytes): " + "; ".join(f"{op}: {text}" for op, text in TRAFFIC.items()) + "\n\n"
    )
    table = header + markdown_table(cols, table_rows)
    payload = {
        "machine": machine(), "world_size": WORLD, "copy_bandwidth_GBps": copy_bw / 1e9,
        "deepspeed": per_rank[0]["deepspeed"], "traffic": TRAFFIC, "rows": rows,
        "note": "timings taken on a shared 2-core machine",
        "dev_shm_left": {"ours": ours_left, "deepspeed": deepspeed_left},
    }  # fmt: skip
    write_results("comm", payload, table)
    _plot(rows, results_dir() / "comm.png")
    print(table)
    print(json.dumps({"copy_bandwidth_GBps": round(copy_bw / 1e9, 2)}))


if __name__ == "__main__":
    main()
