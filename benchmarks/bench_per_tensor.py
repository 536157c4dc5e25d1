"""Per-tensor optimizers under ZeRO (Muon, Adafactor): step time against stage 2 with AdamW on 2 CPU ranks,
and the balance of the whole-parameter assignment. Writes benchmarks/results/per_tensor.{json,md,png}.

    python -m benchmarks.bench_per_tensor [--quick]

Step time: 6 residual MLP blocks (512 -> 1536 -> 512, LayerNorm), ~9.5M parameters, fp32, micro batch
8 x 64 positions, 2 gloo ranks. Engines: stage 2 + AdamW (the baseline), Muon (``MuonWithAuxAdam``: Muon on
the matrices, AdamW on norms and biases) at stages 0-3 and Adafactor at stage 2. All live in each rank's
process and their steps are interleaved in a rotating order (2 warm-up + N timed each), so outside load hits
all alike; step = forward + backward + ``engine.step()``, optimizer phase = ``engine.step()``; medians. At
stage 0 every rank orthogonalises every matrix; at stages 1-3 each rank its own (the assignment).

Balance: [Note: whole parameters per rank] pads each bucket's shards to the most loaded rank. The
imbalance (padded elements / parameter elements) and the most loaded rank's share of the optimizer work
are reported for the benchmark model and, from shapes alone (no memory), for TinyLlama-1.1B's parameters
at 2, 4 and 8 ranks: Muon's (the decoder layers' matrices; embeddings, norms and the output head are
AdamW's, laid out flat) and Adafactor's (all); stages 1-2 with DeepSpeed's
default ``reduce_bucket_size`` (5e8) and stage 3 with one fetch unit per decoder layer ("blocks", the
default) and one per module ("modules").
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.bench_partial_offload import ResidualMLP
from benchmarks.common import machine, markdown_table, peak_rss_bytes, results_dir, run_ranks, write_results

WIDTH, HIDDEN, DEPTH, MICRO, SEQ = 512, 1536, 6, 8, 64
# label -> (stage, optimizer)
ENGINES: dict[str, tuple[int, str]] = {
    "stage 2 AdamW": (2, "AdamW"),
    "stage 0 Muon": (0, "Muon"),
    "stage 1 Muon": (1, "Muon"),
    "stage 2 Muon": (2, "Muon"),
    "stage 3 Muon": (3, "Muon"),
    "stage 2 Adafactor": (2, "Adafactor"),
}
BASELINE = "stage 2 AdamW"
# TinyLlama-1.1B: hidden 2048, intermediate 5632, 22 layers, 32 heads / 4 key-value heads, vocabulary 32000.
LLAMA = {"hidden": 2048, "inter": 5632, "layers": 22, "kv": 256, "vocab": 32000}


def _config(stage: int, optimizer: str) -> dict[str, Any]:
    params: dict[str, Any] = {"lr": 1e-3}
    if optimizer == "Muon":
        params = {"lr": 0.02, "adam_lr": 1e-3}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _rank(rank: int, world: int, width: int, hidden: int, depth: int, steps: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.runtime.zero.per_tensor import owned_counts

    engines = {}
    for label, (stage, optimizer) in ENGINES.items():
        torch.manual_seed(0)
        engines[label], *_ = ds_strategy.initialize(
            model=ResidualMLP(width, hidden, depth), config=_config(stage, optimizer)
        )
    n = sum(p.numel() for p in engines[BASELINE].module.parameters())
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(MICRO, SEQ, width, generator=g), torch.randn(MICRO, SEQ, width, generator=g))
        for _ in range(steps + 2)
    ]
    labels = list(ENGINES)
    step_s: dict[str, list[float]] = {k: [] for k in labels}
    opt_s: dict[str, list[float]] = {k: [] for k in labels}
    for i, (x, y) in enumerate(batches):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:  # rotating: none always first
            engine = engines[label]
            start = time.perf_counter()
            engine.backward(engine(x, y))
            mid = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            if i >= 2:
                step_s[label].append(end - start)
                opt_s[label].append(end - mid)
    rows = []
    for label in labels:
        stage = engines[label].stage
        counts = owned_counts(stage.groups) if stage.whole is not None else []
        padded = sum(gs.layout.total for gs in stage.groups)
        rows.append(
            {
                "engine": label,
                "step_ms": statistics.median(step_s[label]) * 1e3,
                "optimizer_ms": statistics.median(opt_s[label]) * 1e3,
                "imbalance": padded / n,
                "max_share": max(counts) / sum(counts) if counts else None,
            }
        )
    for engine in engines.values():
        engine.destroy()
    return {"params": n, "rows": rows, "peak_rss_MiB": peak_rss_bytes() / 2**20}


def _llama_entries(muon: bool) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], list[int], list[int]]:
    """TinyLlama-1.1B's parameters (``muon``: only Muon's, the decoder layers' matrices; else all, as
    Adafactor steps them) in the engine's order (reverse registration), with the entry indices where a
    stage-3 unit starts: per decoder layer ("blocks") and per module ("modules")."""
    h, i, kv, v = LLAMA["hidden"], LLAMA["inter"], LLAMA["kv"], LLAMA["vocab"]
    entries: list[tuple[str, tuple[int, ...]]] = [("embed_tokens", (v, h))]
    layer_starts, module_starts = [0], [0]
    for layer in range(LLAMA["layers"]):
        layer_starts.append(len(entries))
        for name, shape in (
            ("q_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, h)),
            ("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)),
            ("input_layernorm", (h,)), ("post_attention_layernorm", (h,)),
        ):  # fmt: skip
            if muon and len(shape) != 2:
                continue  # norms: MuonWithAuxAdam's AdamW group, laid out flat
            module_starts.append(len(entries))
            entries.append((f"layers.{layer}.{name}", shape))
    layer_starts.append(len(entries))
    module_starts.append(len(entries))
    if muon:  # embeddings, head and norms are AdamW's
        entries = entries[1:]
        layer_starts = [s - 1 for s in layer_starts[1:]]
        module_starts = [s - 1 for s in module_starts[1:]]
    else:
        entries += [("norm", (h,)), ("lm_head", (v, h))]
        module_starts.append(len(entries) - 1)
    n = len(entries)
    flip = lambda starts: sorted({n - s for s in starts if 0 < n - s < n})  # noqa: E731  (reverse order)
    typed = [(name, shape, torch.float32) for name, shape in reversed(entries)]
    return typed, flip(layer_starts), flip(module_starts)


def llama_balance() -> list[dict[str, Any]]:
    """Imbalance and the most loaded rank's share for TinyLlama-1.1B's shapes (arithmetic only)."""
    from ds_strategy.runtime.layout import FlatLayout

    out = []
    for (optimizer, muon), world in itertools.product((("Muon", True), ("Adafactor", False)), (2, 4, 8)):
        entries, blocks, modules = _llama_entries(muon)
        numel = sum(int(torch.Size(s).numel()) for _, s, _ in entries)
        for label, kwargs in (
            ("stages 1-2 (bucket 5e8)", {"bucket_numel": 500_000_000}),
            ("stage 3, blocks", {"bucket_numel": 2**62, "breaks": blocks}),
            ("stage 3, modules", {"bucket_numel": 2**62, "breaks": modules}),
        ):
            layout = FlatLayout.build(entries, world_size=world, whole_params=True, **kwargs)
            loads = [0] * world
            for index, slot in enumerate(layout.params):
                loads[layout.owner(index) or 0] += slot.numel
            out.append(
                {
                    "optimizer": optimizer,
                    "world": world,
                    "layout": label,
                    "imbalance": layout.total / numel,
                    "max_share": max(loads) / numel,
                    "ideal_share": 1 / world,
                }
            )
    return out


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    rows = {r["engine"]: r for r in payload["rows"]}
    base = rows[BASELINE]
    out = []
    for label in ("stage 2 Muon", "stage 3 Muon", "stage 2 Adafactor"):
        row = rows[label]
        ratios = f"{row['step_ms'] / base['step_ms']:.2f}x / {row['optimizer_ms'] / base['optimizer_ms']:.2f}x"
        out.append((f"{label} vs {BASELINE}: step / optimizer phase", f"{ratios}, imbalance {row['imbalance']:.3f}"))
    for optimizer in ("Muon", "Adafactor"):
        at8 = {r["layout"]: r for r in payload["llama"] if r["world"] == 8 and r["optimizer"] == optimizer}
        out.append(
            (
                f"TinyLlama-1.1B {optimizer} at 8 ranks: imbalance (stages 1-2 / stage 3 blocks)",
                f"{at8['stages 1-2 (bucket 5e8)']['imbalance']:.2f} / {at8['stage 3, blocks']['imbalance']:.2f}",
            )
        )
    return out


def _plot(payload: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    ax = axes[0]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["step_ms"] for r in rows], width=0.4, label="step")
    ax.bar([x + 0.2 for x in xs], [r["optimizer_ms"] for r in rows], width=0.4, label="optimizer phase")
    ax.set_xticks(list(xs), [r["engine"].replace(" ", "\n", 2) for r in rows], fontsize=8)
    ax.set_ylabel(f"ms (median, {payload['world_size']} CPU ranks)")
    ax.legend()
    ax = axes[1]
    for (optimizer, style), label in itertools.product(
        (("Muon", "o-"), ("Adafactor", "s--")), ("stages 1-2 (bucket 5e8)", "stage 3, blocks", "stage 3, modules")
    ):
        pts = [r for r in payload["llama"] if r["layout"] == label and r["optimizer"] == optimizer]
        ax.plot([r["world"] for r in pts], [r["imbalance"] for r in pts], style, label=f"{optimizer}, {label}")
    ax.set_xlabel("ranks")
    ax.set_ylabel("padded / parameter elements")
    ax.set_title("TinyLlama-1.1B, whole-parameter layout", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few steps (smoke run)")
    args = parser.parse_args(argv)
    width, hidden, depth = (64, 128, 2) if args.quick else (WIDTH, HIDDEN, DEPTH)
    steps = 2 if args.quick else 10
    world = 2
    results = run_ranks(_rank, world, width, hidden, depth, steps)
    payload = {"machine": machine(), "quick": args.quick, "world_size": world, "steps": steps, **results[0]}
    payload["peak_rss_MiB"] = max(r["peak_rss_MiB"] for r in results)
    payload["llama"] = llama_balance()
    base = {r["engine"]: r for r in payload["rows"]}[BASELINE]
    rows = [
        [
            r["engine"], f"{r['step_ms']:.0f}", f"{r['step_ms'] / base['step_ms']:.2f}x", f"{r['optimizer_ms']:.1f}",
            f"{r['imbalance']:.3f}", "-" if r["max_share"] is None else f"{r['max_share']:.3f}",
        ]
        for r in payload["rows"]
    ]  # fmt: skip
    llama = [
        [
            r["optimizer"],
            r["world"],
            r["layout"],
            f"{r['imbalance']:.3f}",
            f"{r['max_share']:.3f}",
            f"{r['ideal_share']:.3f}",
        ]
        for r in payload["llama"]
    ]
    table = (
        f"## Per-tensor optimizers, {payload['params'] / 1e6:.1f}M parameters, fp32, {world} CPU ranks\n\n"
        + markdown_table(
            ["engine", "step ms", "vs stage 2 AdamW", "optimizer ms", "imbalance", "most loaded rank's share"], rows
        )
        + "\n\n## Whole-parameter assignment of TinyLlama-1.1B (shapes only)\n\n"
        + markdown_table(["optimizer", "ranks", "layout", "imbalance", "most loaded rank's share", "ideal"], llama)
    )
    write_results("per_tensor", payload, table)
    _plot(payload, results_dir() / "per_tensor.png")
    print(table)
    print(json.dumps(headlines(payload), indent=1))


if __name__ == "__main__":
    main()
