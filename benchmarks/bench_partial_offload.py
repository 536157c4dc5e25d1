"""Partial optimizer offload (``offload_optimizer.ratio``, ZeRO-Offload++) on a CPU rank: step time, optimizer
phase and the split's bookkeeping at ratio 0 (no offload), 0.3, 0.7 and 1.0 (full offload), with the memory
each keeps on the device vs the host. Writes benchmarks/results/partial_offload.{json,md,png}.

    python -m benchmarks.bench_partial_offload [--quick]

Model: 9 residual MLP blocks (512 -> 2048 -> 512, LayerNorm), ~19M parameters, bf16 compute, AdamW, ZeRO
stage 2 on 1 rank, ``reduce_bucket_size`` one matrix (1M elements: a split close to the ratio),
micro batch 8 x 64 positions. The four engines live in one process and their steps are interleaved in a
rotating order (2 warm-up + N timed each), so load from other work on this shared machine hits all alike;
step = forward + backward + step, optimizer phase = ``engine.step()``; medians.

On a CPU-only run the compute device is the host: nothing moves between devices, and the ratio changes
the bookkeeping only (which masters count as offloaded, the device part stepped before the host part).
What this measures is that cost, beside the memory split (``engine.memory_breakdown(by_device=True)``) and
the model's projection for a GPU of the same configuration (``estimate_memory(..., device="cuda",
offload_ratio=...)``'s ``on_device``). Step time vs ratio on a GPU needs a GPU session (docs/finetuning.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import machine, markdown_table, peak_rss_bytes, results_dir, run_ranks, write_results

WIDTH, HIDDEN, DEPTH, MICRO, SEQ = 512, 2048, 9, 8, 64
RATIOS: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0)  # 0: no optimizer offload
MIB = 2**20


class ResidualMLP(nn.Module):
    """Residual blocks of LayerNorm, Linear, GELU, Linear (also bench_per_tensor's model)."""

    def __init__(self, width: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(x.float(), y.float())


def _config(ratio: float, bucket: int) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": "cpu" if ratio > 0 else "none"}
    if 0 < ratio < 1:
        offload["ratio"] = ratio
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "offload_optimizer": offload,
        },
        "steps_per_print": 10**9,
    }


def _rank(rank: int, world: int, width: int, hidden: int, depth: int, steps: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy import estimate_memory

    engines, built = {}, {}
    for ratio in RATIOS:
        torch.manual_seed(0)
        model = ResidualMLP(width, hidden, depth)
        start = time.perf_counter()
        engines[ratio], *_ = ds_strategy.initialize(model=model, config=_config(ratio, width * hidden))
        built[ratio] = time.perf_counter() - start
    n = sum(p.numel() for p in engines[1.0].module.parameters())
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(MICRO, SEQ, width, generator=g), torch.randn(MICRO, SEQ, width, generator=g))
        for _ in range(steps + 2)
    ]
    step_s: dict[float, list[float]] = {r: [] for r in RATIOS}
    opt_s: dict[float, list[float]] = {r: [] for r in RATIOS}
    for i, (x, y) in enumerate(batches):
        order = RATIOS[i % len(RATIOS) :] + RATIOS[: i % len(RATIOS)]  # rotating: no engine always first
        for ratio in order:
            engine = engines[ratio]
            start = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            mid = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            if i >= 2:
                step_s[ratio].append(end - start)
                opt_s[ratio].append(end - mid)
    same = all(
        torch.equal(engines[r].module.blocks[0][1].weight, engines[1.0].module.blocks[0][1].weight) for r in RATIOS[1:]
    )
    rows = []
    for ratio in RATIOS:
        engine = engines[ratio]
        placed = engine.memory_breakdown(by_device=True)
        split = engine.stage.master_split
        shares = [split.share(g, gs) for g, gs in enumerate(engine.stage.groups)] if split is not None else []
        achieved = (
            sum(s * sum(m.numel() for m in gs.masters) for s, gs in zip(shares, engine.stage.groups, strict=True))
            / sum(m.numel() for gs in engine.stage.groups for m in gs.masters)
            if split is not None
            else float(ratio)
        )
        gpu = estimate_memory(n, world, 2, ratio > 0, "bf16", optimizer="AdamW", offload_ratio=achieved or 1.0)
        rows.append(
            {
                "ratio": ratio,
                "host_share": achieved,
                "build_s": built[ratio],
                "step_ms": statistics.median(step_s[ratio]) * 1e3,
                "optimizer_ms": statistics.median(opt_s[ratio]) * 1e3,
                "state_device_MiB": (placed["master"] + placed["optimizer_state"]) / MIB,
                "state_host_MiB": (placed["master_host"] + placed["optimizer_state_host"]) / MIB,
                "gpu_on_device_MiB": gpu.on_device / MIB,
            }
        )
    for engine in engines.values():
        engine.destroy()
    return {"params": n, "rows": rows, "same_weights_as_full_offload": same, "peak_rss_MiB": peak_rss_bytes() / MIB}


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    rows = {r["ratio"]: r for r in payload["rows"]}
    full = rows[1.0]
    out = []
    for ratio in (0.3, 0.7):
        r = rows[ratio]
        out.append(
            (
                f"ratio {ratio}: step / optimizer phase vs full offload",
                f"{r['step_ms'] / full['step_ms']:.2f}x / {r['optimizer_ms'] / full['optimizer_ms']:.2f}x, "
                f"host share {r['host_share']:.2f}, GPU model states {r['gpu_on_device_MiB']:.0f} MiB "
                f"(full offload {full['gpu_on_device_MiB']:.0f})",
            )
        )
    return out


def _plot(payload: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    labels = ["none" if r["ratio"] == 0 else str(r["ratio"]) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["step_ms"] for r in rows], width=0.4, label="step")
    ax.bar([x + 0.2 for x in xs], [r["optimizer_ms"] for r in rows], width=0.4, label="optimizer phase")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("offload_optimizer.ratio (CPU, 1 rank)")
    ax.set_ylabel("ms (median)")
    ax.legend()
    ax = axes[1]
    ax.bar([x - 0.2 for x in xs], [r["state_device_MiB"] for r in rows], width=0.4, label="device (bookkeeping)")
    ax.bar([x + 0.2 for x in xs], [r["state_host_MiB"] for r in rows], width=0.4, label="host")
    ax.plot(list(xs), [r["gpu_on_device_MiB"] for r in rows], "k.-", label="GPU model states (estimate)")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("masters + optimizer state, MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (smoke run)")
    args = parser.parse_args(argv)
    width, hidden, depth = (64, 256, 2) if args.quick else (WIDTH, HIDDEN, DEPTH)
    steps = 2 if args.quick else 12
    (result,) = run_ranks(_rank, 1, width, hidden, depth, steps)
    payload = {"machine": machine(), "quick": args.quick, "world_size": 1, "steps": steps, **result}
    rows = [
        [
            "none" if r["ratio"] == 0 else r["ratio"], f"{r['host_share']:.3f}", f"{r['step_ms']:.0f}",
            f"{r['optimizer_ms']:.1f}", f"{r['build_s']:.2f}", f"{r['state_device_MiB']:.0f}",
            f"{r['state_host_MiB']:.0f}", f"{r['gpu_on_device_MiB']:.0f}",
        ]
        for r in payload["rows"]
    ]  # fmt: skip
    table = (
        f"## Partial optimizer offload, {payload['params'] / 1e6:.1f}M parameters, bf16, stage 2, 1 CPU rank\n\n"
        + markdown_table(
            [
                "ratio",
                "host share",
                "step ms",
                "optimizer ms",
                "build s",
                "device MiB",
                "host MiB",
                "GPU model states MiB (est.)",
            ],
            rows,
        )
        + f"\n\nweights after the run identical to the full offload's: {payload['same_weights_as_full_offload']}"
    )
    write_results("partial_offload", payload, table)
    _plot(payload, results_dir() / "partial_offload.png")
    print(table)
    print(json.dumps(headlines(payload), indent=1))


if __name__ == "__main__":
    main()
