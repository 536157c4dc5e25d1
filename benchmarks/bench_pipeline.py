"""Pipeline parallelism on 2 and 4 CPU processes (issue 25, criterion 6): the measured 1F1B bubble beside
the theory (p - 1) / (m + p - 1) for several micro-batch counts m, and the step time beside DeepSpeed's
PipelineEngine on the same layers and config (when DeepSpeed is installed and its pipeline runs here).

Model: LAYERS pairs of Linear(WIDTH, WIDTH) + GELU and a Linear head, MSE loss, fp32, micro-batch MICRO
rows, ZeRO stage 1, AdamW, partition "parameters" (equal stages). Pipe p = world size (data parallel 1).
Activations and gradients go through the shared-memory channels (the default on one host); the rows
"ds_strategy (process group)" rerun the same (p, m) with DS_STRATEGY_SHM=0 (gloo isend / irecv).
Point-to-point: the pipeline link between 2 ranks, ping-pong of one fp32 tensor per size (one-way time =
round trip / 2, median of P2P_ROUNDS), shared-memory channel against the process group: where the channel
pays off.
Per (p, m): one untimed batch, then REPEATS timed ``train_batch`` calls; step time = median over calls of
the slowest rank's call. Measured bubble = mean over stages of 1 - (the stage's forward + backward compute
time) / (the schedule's wall time): the idle share of each stage while the 1F1B schedule runs (the
optimizer step is outside it). The theory assumes equal stage times and free communication; on a shared
CPU the stages also compete for cores, so the measured bubble is an upper-bound reading.
Writes benchmarks/results/pipeline.{json,md,png}. ``--quick``: a tiny model, p 2, m 1 and 4 (smoke run).

    python -m benchmarks.bench_pipeline [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from benchmarks.common import machine, markdown_table, results_dir, run_each, write_results

LAYERS, WIDTH, MICRO, REPEATS = 8, 1024, 32, 5
QUICK = {"layers": 2, "width": 32, "repeats": 2}
MICRO_COUNTS, QUICK_MICRO_COUNTS = (1, 2, 4, 8), (1, 4)
WORLDS, QUICK_WORLDS = (2, 4), (2,)
DS_MICRO_COUNTS = (4, 8)
PG_MICRO_COUNTS = (4, 8)  # the same (p, m) with the payloads on the process group
P2P_BYTES, QUICK_P2P_BYTES = (4 << 10, 64 << 10, 1 << 20, 16 << 20), (4 << 10, 1 << 20)
P2P_ROUNDS, QUICK_P2P_ROUNDS = 50, 5


def _layers(spec_cls: Any, layers: int, width: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(layers):
        out += [spec_cls(nn.Linear, width, width), nn.GELU()]
    return [*out, spec_cls(nn.Linear, width, width)]


def _config(m: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


def _batches(m: int, width: int, count: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [
        [(torch.randn(MICRO, width, generator=g), torch.randn(MICRO, width, generator=g)) for _ in range(m)]
        for _ in range(count)
    ]


def _ours(rank: int, world: int, m: int, quick: bool) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import LayerSpec, PipelineModule

    layers, width, repeats = (QUICK["layers"], QUICK["width"], QUICK["repeats"]) if quick else (LAYERS, WIDTH, REPEATS)
    module = PipelineModule(_layers(LayerSpec, layers, width), num_stages=world, loss_fn=nn.MSELoss())
    engine, _, _, _ = ds_strategy.initialize(model=module, config=_config(m))
    steps, bubbles = [], []
    for i, batch in enumerate(_batches(m, width, repeats + 1)):
        engine.train_batch(iter(batch))
        if i == 0:
            continue
        t = engine.timing
        steps.append(t["batch_s"])
        bubbles.append(1.0 - t["busy_s"] / t["schedule_s"])
    return {"steps": steps, "bubbles": bubbles}


def _deepspeed(rank: int, world: int, m: int, quick: bool) -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers, width, repeats = (QUICK["layers"], QUICK["width"], QUICK["repeats"]) if quick else (LAYERS, WIDTH, REPEATS)
    deepspeed.init_distributed(dist_backend="gloo")
    module = PipelineModule(_layers(LayerSpec, layers, width), num_stages=world, loss_fn=nn.MSELoss())
    cfg = dict(_config(m), train_batch_size=MICRO * m)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    steps = []
    for i, batch in enumerate(_batches(m, width, repeats + 1)):
        t0 = time.perf_counter()
        engine.train_batch(iter(batch))
        if i:
            steps.append(time.perf_counter() - t0)
    return {"steps": steps}


def _run_one(rank: int, world: int, item: tuple[str, int], quick: bool) -> dict[str, Any]:
    who, m = item
    if who == "DeepSpeed":
        return _deepspeed(rank, world, m, quick)
    os.environ["DS_STRATEGY_SHM"] = "0" if who == PG else "1"  # read when the engine builds its link
    try:
        return _ours(rank, world, m, quick)
    finally:
        os.environ.pop("DS_STRATEGY_SHM")


PG = "ds_strategy (process group)"


def _p2p(rank: int, world: int, item: tuple[str, int], rounds: int) -> float:
    """Median one-way time of the pipeline link (``transport``: "shm" or "process group") for one tensor."""
    import torch.distributed as dist

    from ds_strategy.runtime.pipe.p2p import Link

    transport, nbytes = item
    peer = 1 - rank
    store = dist.distributed_c10d._get_default_store()
    near = frozenset({peer}) if transport == "shm" else frozenset()
    link = Link(torch.device("cpu"), store, shm_peers=near, channel_prefix=f"bench_p2p/{transport}/{nbytes}")
    link.capacity = {peer: 1}
    t = torch.randn(nbytes // 4)
    times = []
    try:
        for i in range(rounds + 2):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                link.send([t], 1, ("ping", 0, "train"))
                link.recv(1, ("pong", 1, "train"))
            else:
                back = link.recv(0, ("ping", 0, "train"))
                link.send(back, 0, ("pong", 1, "train"))
            link.drain()
            if i >= 2:  # the first round negotiates the link and creates the channels
                times.append((time.perf_counter() - start) / 2)
    finally:
        link.close()
    return statistics.median(times)


def run(quick: bool) -> dict[str, Any]:
    from ds_strategy.pipe import bubble_fraction

    rows: list[dict[str, Any]] = []
    for world in QUICK_WORLDS if quick else WORLDS:
        items: list[tuple[str, int]] = [("ds_strategy", m) for m in (QUICK_MICRO_COUNTS if quick else MICRO_COUNTS)]
        items += [(PG, m) for m in (QUICK_MICRO_COUNTS[-1:] if quick else PG_MICRO_COUNTS)]
        if not quick:
            items += [("DeepSpeed", m) for m in DS_MICRO_COUNTS]
        for (who, m), result in run_each(_run_one, world, items, quick, fresh=False):
            row: dict[str, Any] = {"engine": who, "p": world, "m": m, "theory_bubble": bubble_fraction(m, world)}
            if isinstance(result, Exception):
                row["error"] = f"{type(result).__name__}: {str(result).splitlines()[0][:200]}"
            else:
                per_call = list(zip(*[r["steps"] for r in result], strict=True))
                row["step_s"] = statistics.median(max(c) for c in per_call)
                if who == "ds_strategy":
                    per_stage = [statistics.median(r["bubbles"]) for r in result]
                    row["measured_bubble"] = sum(per_stage) / len(per_stage)
                    row["bubble_per_stage"] = per_stage
            rows.append(row)
            print(row, flush=True)
    p2p: list[dict[str, Any]] = []
    p2p_items = [(tr, n) for n in (QUICK_P2P_BYTES if quick else P2P_BYTES) for tr in ("shm", "process group")]
    for (transport, nbytes), result in run_each(
        _p2p, 2, p2p_items, QUICK_P2P_ROUNDS if quick else P2P_ROUNDS, fresh=False
    ):
        entry: dict[str, Any] = {"transport": transport, "bytes": nbytes}
        if isinstance(result, Exception):
            entry["error"] = f"{type(result).__name__}: {str(result).splitlines()[0][:200]}"
        else:
            entry["one_way_s"] = max(result)
        p2p.append(entry)
        print(entry, flush=True)
    derived: dict[str, Any] = {}
    for row in rows:
        if row["engine"] in ("DeepSpeed", PG) and "step_s" in row:
            ours = next(
                (r for r in rows if r["engine"] == "ds_strategy" and r["p"] == row["p"] and r["m"] == row["m"]), None
            )
            name = "deepspeed_over_ours" if row["engine"] == "DeepSpeed" else "process_group_over_shm"
            if ours is not None and "step_s" in ours:
                derived[f"{name}_p{row['p']}_m{row['m']}"] = row["step_s"] / ours["step_s"]
    for n in sorted({e["bytes"] for e in p2p}):
        pair = {e["transport"]: e.get("one_way_s") for e in p2p if e["bytes"] == n}
        if pair.get("shm") and pair.get("process group"):
            derived[f"p2p_process_group_over_shm_{n}B"] = pair["process group"] / pair["shm"]
    return {
        "machine": machine(),
        "quick": quick,
        "model": {
            "layers": QUICK["layers"] if quick else LAYERS,
            "width": QUICK["width"] if quick else WIDTH,
            "micro": MICRO,
        },
        "rows": rows,
        "p2p": p2p,
        "derived": derived,
    }


def table(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["rows"]:
        if "error" in r:
            rows.append((r["engine"], r["p"], r["m"], f"{r['theory_bubble']:.3f}", "-", "-", r["error"]))
            continue
        measured = f"{r['measured_bubble']:.3f}" if "measured_bubble" in r else "-"
        rows.append(
            (r["engine"], r["p"], r["m"], f"{r['theory_bubble']:.3f}", measured, f"{r['step_s'] * 1e3:.1f}", "")
        )
    text = markdown_table(
        ("engine", "p", "m", "theory (p-1)/(m+p-1)", "measured bubble", "step ms (median)", "note"), rows
    )
    p2p = payload.get("p2p", [])
    if not p2p:
        return text
    cells = []
    for n in sorted({e["bytes"] for e in p2p}):
        pair = {e["transport"]: e.get("one_way_s") for e in p2p if e["bytes"] == n}
        shm, pg = pair.get("shm"), pair.get("process group")

        def us(v: float | None) -> str:
            return f"{v * 1e6:.0f}" if v else "-"

        def gbs(v: float | None, n: int = n) -> str:
            return f"{n / v / 1e9:.2f}" if v else "-"

        ratio = f"{pg / shm:.1f}x" if shm and pg else "-"
        cells.append((f"{n // 1024} KiB", us(shm), gbs(shm), us(pg), gbs(pg), ratio))
    text += "\n\nPoint-to-point between 2 ranks (the pipeline link, one fp32 tensor, one-way):\n\n"
    text += markdown_table(
        ("size", "shm us", "shm GB/s", "process group us", "process group GB/s", "process group / shm"), cells
    )
    return text


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p2p = payload.get("p2p", [])
    fig, axes = plt.subplots(1, 2 if p2p else 1, figsize=(11 if p2p else 6.5, 3.5), squeeze=False)
    ax = axes[0][0]
    for p, color in ((2, "tab:blue"), (4, "tab:orange")):
        ours = [r for r in payload["rows"] if r["engine"] == "ds_strategy" and r["p"] == p and "measured_bubble" in r]
        if not ours:
            continue
        ms = [r["m"] for r in ours]
        ax.plot(ms, [r["theory_bubble"] for r in ours], "--", color=color, label=f"theory p={p}")
        ax.plot(ms, [r["measured_bubble"] for r in ours], "o-", color=color, label=f"measured p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share of a stage)")
    ax.set_title("1F1B bubble on CPU processes")
    ax.legend()
    if p2p:
        ax2 = axes[0][1]
        for transport, marker in (("shm", "o-"), ("process group", "s--")):
            pts = [(e["bytes"], e["one_way_s"]) for e in p2p if e["transport"] == transport and "one_way_s" in e]
            if pts:
                ax2.plot([b for b, _ in pts], [t * 1e6 for _, t in pts], marker, label=transport)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("message bytes")
        ax2.set_ylabel("one-way time (us)")
        ax2.set_title("pipeline link, 2 ranks")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(results_dir() / "pipeline.png", dpi=120)
    plt.close(fig)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for r in payload.get("rows", []):
        if r["engine"] == "ds_strategy" and "measured_bubble" in r and r["m"] in (4, 8):
            out.append(
                (f"bubble p={r['p']} m={r['m']} (theory {r['theory_bubble']:.2f})", f"{r['measured_bubble']:.2f}")
            )
    for k, v in payload.get("derived", {}).items():
        if k.startswith("deepspeed_over_ours"):
            out.append((f"DeepSpeed / ds_strategy step time ({k.split('_', 3)[-1]})", f"{v:.2f}x"))
        elif k.startswith("process_group_over_shm"):
            where = " ".join(k.rsplit("_", 2)[-2:])
            out.append((f"step time, process group / shm link ({where})", f"{v:.2f}x"))
        elif k.startswith("p2p_"):
            out.append((f"pipeline link one-way, process group / shm ({k.rsplit('_', 1)[-1]})", f"{v:.1f}x"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, p 2, m 1 and 4, one set of processes")
    args = parser.parse_args(argv)
    payload = run(args.quick)
    text = table(payload)
    write_results("pipeline", payload, text)
    plot(payload)
    print(text)


if __name__ == "__main__":
    main()
