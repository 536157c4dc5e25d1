"""End-to-end training step on 2 CPU ranks, every ZeRO stage beside its peers in one run: torch DDP, torch
FSDP2 (``fully_shard`` per block), ds_strategy stages 0, 1, 2, 2 + offload, 3, 3 + offload and, when
installed, DeepSpeed at the same stages with the same config (stage3_* keys included). GPT of
ds_strategy.demo (8 layers, d=512, seq 256, micro batch 4, ~25M parameters, fp32, AdamW). Each case runs in
fresh processes (so peak RSS is its own): 2 warm-up + 5 timed steps, slowest rank's median s/step, largest rank's
peak RSS. Then (unless --only) stage 2, 3 and 3 + offload are timed again interleaved step by step in the
same processes (``--paired N`` does only that): load from other work hits all three alike, so that median
ratio is the noise-robust stage-3 / stage-2 figure. Derived (issue 7): stage 3 step time over stage 2's, and
stage 3's peak-RSS saving against DDP as a fraction of the model-state bytes stage 3 saves in theory
(fp32 params + grads + Adam m, v = 16 bytes/param, of which a rank keeps 1/N: 16 P (1 - 1/N)).
Writes benchmarks/results/e2e.{json,md,png} (NAME.* with --name). ``--quick``: a tiny model and every case
one after another in one set of processes (a smoke run: one start-up instead of 14; RSS not per case).
``--repeat N`` runs the chosen cases N times in turn and reports each figure's median over the N rounds.

    python -m benchmarks.bench_e2e [--quick] [--only "case,case"] [--name NAME] [--paired N] [--repeat N]
    python -m benchmarks.bench_e2e --device cuda [--quick] [--only ...] [--name NAME]   # one GPU: e2e_cuda.py

glibc's malloc keeps freed multi-MiB blocks resident once its dynamic mmap threshold has grown, which
inflates the peak RSS of every peer; the MALLOC_* environment of the run is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from typing import Any

from benchmarks.common import (
    machine,
    markdown_table,
    peak_rss_bytes,
    results_dir,
    run_each,
    run_ranks,
    write_results,
)
from benchmarks.training import (
    QUICK_SHAPE,
    SHAPE,
    STAGE3,
    WARMUP,
    build_engine,
    ds_config,
    model_and_batches,
    peer_step,
    time_steps,
)

WORLD = 2
STEPS, QUICK_STEPS = 5, 3
PAIRED_STEPS, QUICK_PAIRED_STEPS = 8, 3
MODEL_STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + Adam m + v
RSS_SAVING_TARGET, STEP_RATIO_TARGET = 0.70, 1.15  # issue 7, criterion 8

Case = tuple[str, str, int, bool]  # (label, peer, stage, offload)
ZERO_CASES = ((0, False), (1, False), (2, False), (2, True), (3, False), (3, True))
PAIRED = {"stage 2": (2, False), "stage 3": (3, False), "stage 3 + offload": (3, True)}


def label(peer: str, stage: int, offload: bool) -> str:
    return f"{peer} stage {stage}{' + offload' if offload else ''}"


def all_cases(with_deepspeed: bool) -> list[Case]:
    cases: list[Case] = [("torch DDP", "torch DDP", 0, False), ("torch FSDP2", "torch FSDP2", 3, False)]
    for peer in ("ds_strategy", "deepspeed") if with_deepspeed else ("ds_strategy",):
        cases += [(label(peer, st, off), peer, st, off) for st, off in ZERO_CASES]
    return cases


def _run_one(rank: int, world: int, case: Case, shape: dict[str, int], steps: int) -> dict:
    _, peer, stage, offload = case
    model, batches = model_and_batches(shape, steps + WARMUP, rank)
    params = sum(p.numel() for p in model.parameters())
    seconds = time_steps(peer_step(peer, model, stage, offload, shape["micro"]), batches)
    return {"seconds_per_step": seconds, "peak_rss": peak_rss_bytes(), "params": params}


def run_cases(cases: list[Case], shape: dict[str, int], steps: int, fresh: bool = True) -> list[dict[str, Any]]:
    """Each case in fresh ranks (``fresh``; all in one set for smoke runs); a peer that cannot run here is
    recorded with its error, not fatal."""
    records = []
    start = time.monotonic()
    for (name, peer, stage, offload), per_rank in run_each(_run_one, WORLD, cases, shape, steps, fresh=fresh):
        record: dict[str, Any] = {"case": name, "peer": peer, "stage": stage, "offload": offload}
        wall, start = time.monotonic() - start, time.monotonic()
        if isinstance(per_rank, Exception):
            print(f"{name}: failed: {per_rank}", flush=True)
            records.append({**record, "error": str(per_rank)})
            continue
        record.update(
            ranks=per_rank,
            seconds_per_step=max(r["seconds_per_step"] for r in per_rank),
            peak_rss=max(r["peak_rss"] for r in per_rank),
            wall_s=wall,
        )
        records.append(record)
        rss = record["peak_rss"] / 2**30
        print(f"{name}: {record['seconds_per_step']:.3f} s/step, peak RSS {rss:.2f} GiB/rank ({wall:.0f}s)", flush=True)
    return records


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``--repeat``: one record per case, its median s/step and median peak RSS over the rounds (each round
    every case once, in fresh processes, in the same order), with every round's figures kept. On a shared
    machine a burst of other work lands on whichever case runs then; the median of rounds drops it."""
    merged = []
    for per_round in zip(*rounds, strict=True):
        failed = next((r for r in per_round if "error" in r), None)
        if failed is not None:
            merged.append(failed)
            continue
        steps = [r["seconds_per_step"] for r in per_round]
        rss = [r["peak_rss"] for r in per_round]
        merged.append({
            **per_round[0],
            "seconds_per_step": statistics.median(steps),
            "peak_rss": statistics.median(rss),
            "rounds": [{"seconds_per_step": a, "peak_rss": b} for a, b in zip(steps, rss, strict=True)],
        })  # fmt: skip
    return merged


def _paired(rank: int, world: int, shape: dict[str, int], steps: int) -> dict[str, list[float]]:
    """Stage 2, stage 3 and stage 3 + offload engines in the same processes, their steps interleaved;
    per-step seconds for each."""
    engines, batches = {}, []
    for name, (stage, offload) in PAIRED.items():
        model, batches = model_and_batches(shape, steps + WARMUP, rank)
        engines[name] = build_engine("ds_strategy", model, ds_config(stage, offload, shape["micro"]))
    times: dict[str, list[float]] = {name: [] for name in PAIRED}
    for i, b in enumerate(batches):
        for name, engine in engines.items():
            start = time.perf_counter()
            loss = engine(b)
            engine.backward(loss)
            engine.step()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return times


def run_paired(shape: dict[str, int], steps: int) -> dict[str, Any]:
    """Per step, the slowest rank's seconds of each engine; min, median and median ratio to stage 2."""
    per_rank = run_ranks(_paired, WORLD, shape, steps)
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(steps)] for k in PAIRED}
    summary = {
        k: {
            "min_s": min(v),
            "median_s": statistics.median(v),
            "median_ratio_to_stage_2": statistics.median(a / b for a, b in zip(v, slowest["stage 2"], strict=True)),
        }
        for k, v in slowest.items()
    }
    return {"steps": slowest, "summary": summary}


def _paired_table(paired: dict[str, Any]) -> str:
    rows = [
        (f"ds_strategy {k}", f"{s['min_s']:.3f}", f"{s['median_s']:.3f}", f"{s['median_ratio_to_stage_2']:.3f}")
        for k, s in paired["summary"].items()
    ]
    return markdown_table(("case (interleaved)", "min s/step", "median s/step", "median ratio to stage 2"), rows)


def derived(records: list[dict[str, Any]], params: int | None, paired: dict[str, Any] | None) -> dict[str, Any]:
    """Issue 7's figures from the table (and the interleaved run when there is one)."""
    ok = {r["case"]: r for r in records if "error" not in r}
    out: dict[str, Any] = {}
    s2, s3, s3o = (ok.get(label("ds_strategy", st, off)) for st, off in ((2, False), (3, False), (3, True)))
    if s2 and s3:
        out["stage3_over_stage2_step"] = s3["seconds_per_step"] / s2["seconds_per_step"]
    if s2 and s3o:
        out["stage3_offload_over_stage2_step"] = s3o["seconds_per_step"] / s2["seconds_per_step"]
    if paired:
        out["paired_stage3_over_stage2_step"] = paired["summary"]["stage 3"]["median_ratio_to_stage_2"]
        out["paired_stage3_offload_over_stage2_step"] = paired["summary"]["stage 3 + offload"][
            "median_ratio_to_stage_2"
        ]
    if params:
        theory = MODEL_STATE_BYTES_PER_PARAM * params * (1 - 1 / WORLD)
        out["theoretical_stage3_saving_bytes"] = theory
        out["theory"] = (
            f"{MODEL_STATE_BYTES_PER_PARAM} bytes/param (fp32 params + grads + Adam m, v) x {params} params x "
            f"(1 - 1/{WORLD}) = {theory / 2**20:.0f} MiB per rank"
        )
        ddp = ok.get("torch DDP")
        for key, case in (("stage3", s3), ("stage3_offload", s3o), ("fsdp2", ok.get("torch FSDP2"))):
            if ddp and case:
                out[f"{key}_rss_saving_fraction_of_theory"] = (ddp["peak_rss"] - case["peak_rss"]) / theory
    ds3 = ok.get(label("deepspeed", 3, False))
    if s3 and ds3:
        out["stage3_rss_over_deepspeed_stage3"] = s3["peak_rss"] / ds3["peak_rss"]
    out["targets"] = {"step_ratio_max": STEP_RATIO_TARGET, "rss_saving_fraction_min": RSS_SAVING_TARGET}
    return out


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> str:
    return f"{a[key] / b[key]:.2f}x" if a and b else "-"


def table(records: list[dict[str, Any]]) -> str:
    ok = {r["case"]: r for r in records if "error" not in r}
    ddp = ok.get("torch DDP")
    rows = []
    for r in records:
        if "error" in r:
            rows.append((r["case"], "failed", "-", "-", "-", "-"))
            continue
        ds = ok.get(label("deepspeed", r["stage"], r["offload"])) if r["peer"] == "ds_strategy" else None
        rows.append(
            (
                r["case"], f"{r['seconds_per_step']:.3f}", f"{r['peak_rss'] / 2**30:.2f}",
                _ratio(r, ddp, "seconds_per_step"), _ratio(r, ds, "seconds_per_step"), _ratio(r, ds, "peak_rss"),
            )
        )  # fmt: skip
    columns = ("case", "s/step (slowest rank)", "peak RSS GiB (max rank)", "step vs DDP", "step vs DeepSpeed",
               "RSS vs DeepSpeed")  # fmt: skip
    return markdown_table(columns, rows)


def _rounds_table(records: list[dict[str, Any]]) -> str:
    """``--repeat``: every round's s/step per case (the table above holds their medians)."""
    rows = [(r["case"], *(f"{x['seconds_per_step']:.3f}" for x in r["rounds"])) for r in records if "rounds" in r]
    rounds = max((len(r["rounds"]) for r in records if "rounds" in r), default=0)
    return "Each round (s/step, slowest rank):\n\n" + markdown_table(
        ("case", *(f"round {i + 1}" for i in range(rounds))), rows
    )


DERIVED = {  # issue 7's figures: key in the JSON -> what it is
    "stage3_over_stage2_step": "stage 3 / stage 2 step time (table)",
    "stage3_offload_over_stage2_step": "stage 3 + offload / stage 2 step time (table)",
    "paired_stage3_over_stage2_step": "stage 3 / stage 2 step time (interleaved, median)",
    "paired_stage3_offload_over_stage2_step": "stage 3 + offload / stage 2 step time (interleaved, median)",
    "stage3_rss_saving_fraction_of_theory": "stage 3 peak-RSS saving vs DDP, fraction of theory",
    "stage3_offload_rss_saving_fraction_of_theory": "stage 3 + offload peak-RSS saving vs DDP, fraction of theory",
    "fsdp2_rss_saving_fraction_of_theory": "FSDP2 peak-RSS saving vs DDP, fraction of theory",
    "stage3_rss_over_deepspeed_stage3": "stage 3 peak RSS / DeepSpeed stage 3 peak RSS",
}


def _derived_value(d: dict[str, Any], key: str) -> str:
    return f"{100 * d[key]:.0f}%" if "fraction" in key else f"{d[key]:.3f}"


def _derived_text(d: dict[str, Any]) -> str:
    lines = ["Issue 7 (stage 3):", ""]
    if "theory" in d:
        lines.append(f"- theoretical model-state saving of stage 3: {d['theory']}")
    for key, text in DERIVED.items():
        if key in d:
            value = _derived_value(d, key)
            lines.append(f"- {text}: {value}")
    lines.append(
        f"- targets: step time <= {STEP_RATIO_TARGET}x stage 2; saving >= {100 * RSS_SAVING_TARGET:.0f}% of theory; "
        "RSS below DeepSpeed stage 3"
    )
    return "\n".join(lines)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md."""
    out = []
    ok = {r["case"]: r for r in payload.get("cases", []) if "error" not in r}
    ddp = ok.get("torch DDP")
    for st, off in ZERO_CASES:
        ours, ds = ok.get(label("ds_strategy", st, off)), ok.get(label("deepspeed", st, off))
        if ours and ds:
            out.append((f"{label('ds_strategy', st, off)}: step / RSS vs DeepSpeed",
                        f"{_ratio(ours, ds, 'seconds_per_step')} / {_ratio(ours, ds, 'peak_rss')}"))  # fmt: skip
        if ours and ddp:
            out.append((f"{label('ds_strategy', st, off)}: step / RSS vs DDP",
                        f"{_ratio(ours, ddp, 'seconds_per_step')} / {_ratio(ours, ddp, 'peak_rss')}"))  # fmt: skip
    s3, fsdp = ok.get(label("ds_strategy", 3, False)), ok.get("torch FSDP2")
    if s3 and fsdp:
        out.append(("ds_strategy stage 3: step / RSS vs FSDP2",
                    f"{_ratio(s3, fsdp, 'seconds_per_step')} / {_ratio(s3, fsdp, 'peak_rss')}"))  # fmt: skip
    d = payload.get("derived", {})
    targets = {"step": f"target <= {STEP_RATIO_TARGET}", "fraction": f"target >= {100 * RSS_SAVING_TARGET:.0f}%"}
    for key in ("stage3_over_stage2_step", "paired_stage3_over_stage2_step", "stage3_rss_saving_fraction_of_theory"):
        if key in d:
            target = targets["fraction" if "fraction" in key else "step"]
            out.append((DERIVED[key], f"{_derived_value(d, key)} ({target})"))
    if "stage3_rss_over_deepspeed_stage3" in d:
        out.append(
            (
                DERIVED["stage3_rss_over_deepspeed_stage3"],
                f"{_derived_value(d, 'stage3_rss_over_deepspeed_stage3')} (target < 1)",
            )
        )
    return out


def plot_step_and_rss(records: list[dict[str, Any]], name: str) -> None:
    """Two bar charts side by side (s/step, peak RSS per rank) into benchmarks/results/NAME.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    colors = {"ds_strategy": "tab:blue", "deepspeed": "tab:orange"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.35 * len(ok) + 1.5))
    labels = [r["case"] for r in ok][::-1]
    cols = [colors.get(r["peer"], "tab:gray") for r in ok][::-1]
    a.barh(labels, [r["seconds_per_step"] for r in ok][::-1], color=cols)
    a.set_xlabel(f"seconds per step ({WORLD} ranks, CPU), lower is better")
    b.barh(labels, [r["peak_rss"] / 2**30 for r in ok][::-1], color=cols)
    b.set_xlabel("peak RSS per rank (GiB), lower is better")
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(results_dir() / f"{name}.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 3 steps, every case in one set of processes (smoke run)"
    )
    parser.add_argument("--only", default="", help="comma-separated case labels to run (no interleaved run)")
    parser.add_argument(
        "--name", default=None, help="results file name (benchmarks/results/NAME.*; default e2e, e2e_cuda on cuda)"
    )
    parser.add_argument("--paired", type=int, default=0, help="only the interleaved stage 2/3/3+offload, N steps")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the cases N times in turn; each figure is the median of the N runs"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: 2 CPU ranks (default); cuda: one GPU, NCCL, vs DeepSpeed and FSDP2 (benchmarks/e2e_cuda.py)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        from benchmarks import e2e_cuda

        if args.paired:
            parser.error("--paired is a CPU measurement; it does not combine with --device cuda")
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        e2e_cuda.main(args.quick, only, args.name or "e2e_cuda")
        return
    args.name = args.name or "e2e"
    shape, steps = (QUICK_SHAPE, QUICK_STEPS) if args.quick else (SHAPE, STEPS)
    head = {"machine": machine(), "shape": shape, "world_size": WORLD, "stage3_keys": STAGE3,
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "note": "timings on a shared 2-core machine unless said otherwise"}  # fmt: skip
    if args.paired:
        paired = run_paired(shape, args.paired)
        text = _paired_table(paired)
        write_results(args.name, {**head, "paired": paired}, text)
        print(text)
        return
    cases = all_cases(importlib.util.find_spec("deepspeed") is not None)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {c[0] for c in cases}
    if unknown:
        raise SystemExit(f"--only: unknown case(s) {sorted(unknown)}; cases: {[c[0] for c in cases]}")
    chosen = [c for c in cases if not only or c[0] in only]
    records = merge_rounds([run_cases(chosen, shape, steps, fresh=not args.quick) for _ in range(max(1, args.repeat))])
    paired = None
    if not only:
        try:
            paired = run_paired(shape, QUICK_PAIRED_STEPS if args.quick else PAIRED_STEPS)
        except Exception as err:  # the table above still stands; the summary shows the ratio missing
            print(f"interleaved stage 2/3 run failed: {err}", flush=True)
    params = next((r["ranks"][0]["params"] for r in records if "ranks" in r), None)
    figures = derived(records, params, paired)
    text = table(records)
    if args.repeat > 1:
        text += "\n\n" + _rounds_table(records)
    if paired:
        text += "\n\nInterleaved in the same processes (noise-robust ratio):\n\n" + _paired_table(paired)
    text += "\n\n" + _derived_text(figures)
    if args.quick:
        text += "\n\n--quick: tiny model, every case in one set of processes (peak RSS is not per case): a smoke run."
    payload = {
        **head,
        "params": params,
        "steps": steps,
        "rounds": max(1, args.repeat),
        "fresh_processes_per_case": not args.quick,
        "cases": records,
        "paired": paired,
        "derived": figures,
    }
    write_results(args.name, payload, text)
    plot_step_and_rss(records, args.name)
    print(text)


if __name__ == "__main__":
    main()
