"""Pipeline parallelism on 2 and 4 CPU processes (issue 25, criterion 6): the measured 1F1B bubble beside
the theory (p - 1) / (m + p - 1) for several micro-batch counts m, and the step time beside DeepSpeed's
PipelineEngine on the same layers and config (when DeepSpeed is installed and its pipeline runs here).

Model: LAYERS pairs of Linear(WIDTH, WIDTH) + GELU and a Linear head, MSE loss, fp32, micro-batch MICRO
rows, ZeRO stage 1, AdamW, partition "parameters" (equal stages). Pipe p = world size (data parallel 1).
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

LAYERS, WIDTH, MICRO, REPEATS = 8, 256, 16, 5
QUICK = {"layers": 2, "width": 32, "repeats": 2}
MICRO_COUNTS, QUICK_MICRO_COUNTS = (1, 2, 4, 8), (1, 4)
WORLDS, QUICK_WORLDS = (2, 4), (2,)
DS_MICRO_COUNTS = (4, 8)


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
    return _ours(rank, world, m, quick) if who == "ds_strategy" else _deepspeed(rank, world, m, quick)


def run(quick: bool) -> dict[str, Any]:
    from ds_strategy.pipe import bubble_fraction

    rows: list[dict[str, Any]] = []
    for world in QUICK_WORLDS if quick else WORLDS:
        items: list[tuple[str, int]] = [("ds_strategy", m) for m in (QUICK_MICRO_COUNTS if quick else MICRO_COUNTS)]
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
    derived: dict[str, Any] = {}
    for row in rows:
        if row["engine"] == "DeepSpeed" and "step_s" in row:
            ours = next(
                (r for r in rows if r["engine"] == "ds_strategy" and r["p"] == row["p"] and r["m"] == row["m"]), None
            )
            if ours is not None and "step_s" in ours:
                derived[f"deepspeed_over_ours_p{row['p']}_m{row['m']}"] = row["step_s"] / ours["step_s"]
    return {
        "machine": machine(),
        "quick": quick,
        "model": {
            "layers": QUICK["layers"] if quick else LAYERS,
            "width": QUICK["width"] if quick else WIDTH,
            "micro": MICRO,
        },
        "rows": rows,
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
    return markdown_table(
        ("engine", "p", "m", "theory (p-1)/(m+p-1)", "measured bubble", "step ms (median)", "note"), rows
    )


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
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
        out.append((f"DeepSpeed / ds_strategy step time ({k.split('_', 3)[-1]})", f"{v:.2f}x"))
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
