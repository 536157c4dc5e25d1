"""torch.compile through the engine on 2 CPU ranks (issue 24, part 4): steady-state step time of torch DDP
and ds_strategy stages 0, 2 and 3, eager and compiled (inductor), and the compile time, on the e2e
benchmark's GPT (benchmarks/training.py SHAPE: 8 layers, d 512, seq 256, micro batch 4, ~25M parameters,
fp32, AdamW). DDP compiled is ``torch.compile(DDP(model))`` (dynamo's DDPOptimizer splits the graph at the
gradient buckets); ds_strategy compiled is the ``compile`` config block (stages 0-2: the module's forward in
one graph; stage 3: the block forward, one graph shared by the 8 blocks, gathers at block boundaries).

Two phases:
1. compile time: each compiled case in fresh processes with inductor's on-disk caches off, so nothing
   compiled earlier is reused; the first step (tracing + code generation + the step) and the second are
   timed, compile time = first step - second step.
2. steady state: every case in one set of processes, WARMUP untimed steps each, then ROUNDS rounds of one
   step of every case in turn, a barrier before each step (load from other work hits every case alike);
   per case the median over rounds of the slower rank's seconds, and the median of the per-round ratio
   compiled stage 2 / compiled DDP (the target: within 1.1x).
Writes benchmarks/results/compile.{json,md,png}. ``--quick``: QUICK_SHAPE, backend aot_eager (no C++ code
generation: a smoke run of the plumbing, not a figure), 3 rounds.

    python -m benchmarks.bench_compile [--quick] [--rounds N] [--steady-only]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.common import machine, markdown_table, results_dir, run_each, write_results
from benchmarks.training import QUICK_SHAPE, SHAPE, ds_config, model_and_batches, torch_step

WORLD = 2
WARMUP = 3
ROUNDS, QUICK_ROUNDS = 10, 3
TARGET = 1.1  # compiled stage 2 over compiled DDP
CASES = (
    "torch DDP",
    "torch DDP compiled",
    "ds_strategy stage 0",
    "ds_strategy stage 0 compiled",
    "ds_strategy stage 2",
    "ds_strategy stage 2 compiled",
    "ds_strategy stage 3",
    "ds_strategy stage 3 compiled",
)
COLUMNS = ("case", "s/step (median)", "vs same eager", "vs DDP compiled", "first step s", "compile s")


def _step(case: str, model: nn.Module, shape: dict[str, int], backend: str) -> Callable[[Any], None]:
    import ds_strategy

    compiled = case.endswith("compiled")
    if case.startswith("torch DDP"):
        ddp: nn.Module = nn.parallel.DistributedDataParallel(model)
        return torch_step(torch.compile(ddp, backend=backend) if compiled else ddp)  # type: ignore[arg-type]
    stage = int(case.split()[2])
    config = ds_config(stage, False, shape["micro"])
    if compiled:
        config["compile"] = {"enabled": True, "backend": backend}
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(b: Any) -> None:
        loss = engine(b)
        engine.backward(loss)
        engine.step()

    return step


def _timed(step: Callable[[Any], None], batch: Any) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    step(batch)
    return time.perf_counter() - start


def _first_steps(rank: int, world: int, case: str, quick: bool, backend: str) -> dict[str, float]:
    """Phase 1: the first two steps of one compiled case in fresh processes, caches off."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    shape = QUICK_SHAPE if quick else SHAPE
    model, batches = model_and_batches(shape, 2, rank)
    step = _step(case, model, shape, backend)
    first = _timed(step, batches[0])
    return {"first": first, "second": _timed(step, batches[1])}


def _rounds(rank: int, world: int, _item: str, quick: bool, backend: str, rounds: int) -> dict[str, list[float]]:
    """Phase 2: every case here, warmed up, then one step of each in turn per round."""
    shape = QUICK_SHAPE if quick else SHAPE
    steps = {}
    for case in CASES:
        model, batches = model_and_batches(shape, WARMUP + rounds, rank)  # seed 0: the same weights everywhere
        steps[case] = (_step(case, model, shape, backend), batches)
        for b in batches[:WARMUP]:
            steps[case][0](b)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for r in range(rounds):
        for case, (step, batches) in steps.items():
            times[case].append(_timed(step, batches[WARMUP + r]))
    return times


def run(quick: bool, rounds: int | None = None, steady_only: bool = False) -> dict[str, Any]:
    backend = "aot_eager" if quick else "inductor"
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    first: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    compiled_cases = [] if steady_only else [c for c in CASES if c.endswith("compiled")]
    for case, result in run_each(_first_steps, WORLD, compiled_cases, quick, backend, fresh=not quick):
        if isinstance(result, Exception):
            errors[case] = f"{type(result).__name__}: {result}"
            continue
        first[case] = {k: max(r[k] for r in result) for k in ("first", "second")}  # the slower rank
        print(f"{case}: first step {first[case]['first']:.1f} s", flush=True)
    per_round: dict[str, list[float]] = {}
    for _, result in run_each(_rounds, WORLD, ["all cases"], quick, backend, rounds):
        if isinstance(result, Exception):
            errors.update({c: f"{type(result).__name__}: {result}" for c in CASES})
            continue
        per_round = {c: [max(ts) for ts in zip(*(r[c] for r in result), strict=True)] for c in CASES}
    records = []
    for case in CASES:
        record: dict[str, Any] = {"case": case}
        if case in per_round:
            record["seconds_per_step"] = statistics.median(per_round[case])
            record["round_seconds"] = per_round[case]
        if case in first:
            record["first_step_s"] = first[case]["first"]
            record["compile_s"] = first[case]["first"] - first[case]["second"]
        if case in errors:
            record["error"] = errors[case]
        records.append(record)
    derived: dict[str, Any] = {}
    if per_round:
        s2, ddp = per_round["ds_strategy stage 2 compiled"], per_round["torch DDP compiled"]
        derived["stage2_compiled_over_ddp_compiled"] = statistics.median(a / b for a, b in zip(s2, ddp, strict=True))
        for stage in (0, 2, 3):
            eager, comp = per_round[f"ds_strategy stage {stage}"], per_round[f"ds_strategy stage {stage} compiled"]
            derived[f"stage{stage}_compiled_speedup"] = statistics.median(
                a / b for a, b in zip(eager, comp, strict=True)
            )
        derived["ddp_compiled_speedup"] = statistics.median(
            a / b for a, b in zip(per_round["torch DDP"], ddp, strict=True)
        )
    return {
        "machine": machine(),
        "quick": quick,
        "steady_only": steady_only,
        "backend": backend,
        "shape": QUICK_SHAPE if quick else SHAPE,
        "world_size": WORLD,
        "warmup": WARMUP,
        "rounds": rounds,
        "target_stage2_over_ddp": TARGET,
        "cases": records,
        "derived": derived,
    }


def table(payload: dict[str, Any]) -> str:
    by = {r["case"]: r for r in payload["cases"]}
    ddp = by["torch DDP compiled"].get("seconds_per_step")
    rows = []
    for r in payload["cases"]:
        if "seconds_per_step" not in r:
            rows.append((r["case"], "failed", "", "", "", r.get("error", "").strip().splitlines()[-1][:100]))
            continue
        eager = by.get(r["case"].removesuffix(" compiled"), {}).get("seconds_per_step")
        rows.append((
            r["case"],
            f"{r['seconds_per_step']:.3f}",
            f"{r['seconds_per_step'] / eager:.2f}x" if eager and r["case"].endswith("compiled") else "",
            f"{r['seconds_per_step'] / ddp:.2f}x" if ddp else "",
            f"{r['first_step_s']:.1f}" if "first_step_s" in r else "",
            f"{r['compile_s']:.1f}" if "compile_s" in r else "",
        ))  # fmt: skip
    d = payload["derived"]
    lines = [
        f"Training step, {payload['world_size']} CPU ranks, fp32 AdamW, GPT {payload['shape']}, backend "
        f"{payload['backend']}; median of {payload['rounds']} interleaved rounds after {payload['warmup']} warm-up "
        "steps (slower rank)."
        + (
            ""
            if payload.get("steady_only")
            else " First step and compile time (first - second step) from fresh processes, inductor caches off."
        ),
        "",
        markdown_table(COLUMNS, rows),
    ]
    if "stage2_compiled_over_ddp_compiled" in d:
        lines += ["", f"Compiled stage 2 / compiled DDP (median per-round ratio): "
                  f"{d['stage2_compiled_over_ddp_compiled']:.2f}x (target <= {payload['target_stage2_over_ddp']}x). "
                  "Speed-up of compiling (eager / compiled): "
                  + ", ".join(f"stage {s} {d[f'stage{s}_compiled_speedup']:.2f}x" for s in (0, 2, 3))
                  + f", DDP {d['ddp_compiled_speedup']:.2f}x."]  # fmt: skip
    return "\n".join(lines)


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in payload["cases"] if "seconds_per_step" in r]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["tab:orange" if r["case"].endswith("compiled") else "tab:blue" for r in ok]
    ax.barh([r["case"] for r in ok], [r["seconds_per_step"] for r in ok], color=colors)
    ax.set_xlabel(f"s per training step (median, lower is better; backend {payload['backend']})")
    ax.set_title("Eager vs torch.compile, 2 CPU ranks")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(results_dir() / "compile.png", dpi=120)
    plt.close(fig)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md."""
    d = payload.get("derived", {})
    out = []
    if "stage2_compiled_over_ddp_compiled" in d:
        out.append(("compiled stage 2 / compiled DDP: s/step", f"{d['stage2_compiled_over_ddp_compiled']:.2f}x"))
        out += [(f"stage {s}: eager / compiled s/step", f"{d[f'stage{s}_compiled_speedup']:.2f}x") for s in (0, 2, 3)]
    for r in payload.get("cases", []):
        if "compile_s" in r:
            out.append((f"{r['case']}: compile s", f"{r['compile_s']:.1f}"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, backend aot_eager, one set of processes")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved timed rounds (default {ROUNDS})")
    parser.add_argument(
        "--steady-only",
        action="store_true",
        help="skip the compile-time phase; write compile_steady.{json,md} (compile.* keeps its compile times)",
    )
    args = parser.parse_args(argv)
    payload = run(args.quick, args.rounds, args.steady_only)
    text = table(payload)
    write_results("compile_steady" if args.steady_only else "compile", payload, text)
    if not args.steady_only:
        plot(payload)
    print(text)


if __name__ == "__main__":
    main()
