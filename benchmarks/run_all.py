"""Run every benchmark beside its peers in one run (``nox -s bench``), then write a summary of their
headline ratios: benchmarks/results/summary.{md,json}.

    python -m benchmarks.run_all [NAME ...] [--quick] [--results DIR] [--summary-only]

Benchmarks (module ``benchmarks.bench_NAME``, each exposing ``main(argv)`` that writes NAME.{json,md,png}
and ``headlines(payload)`` giving the summary's (figure, value) pairs): see BENCHMARKS. ``engine`` and
``zero3`` select ``e2e`` (whose stage-0..3 table replaced them). A benchmark that fails is reported in the
summary and the exit status; the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

BENCHMARKS = (
    "optim",
    "comm",
    "e2e",
    "checkpoint",
    "activation_checkpointing",
    "lora",
    "aio",
    "nvme",
    "hybrid",
    "compile",
    "pipeline",
    "moe",
    "zeropp",
    "sequence_parallel",
    "per_tensor",
    "qlora",
)
ALIASES = {"engine": "e2e", "zero3": "e2e"}
PEERS = {
    "optim": "torch.optim.AdamW (foreach, fused), DeepSpeedCPUAdam, a memory-traffic ceiling",
    "comm": "gloo, DeepSpeed's shm all-reduce, memory-traffic bounds",
    "e2e": "torch DDP, torch FSDP2, DeepSpeed stages 0-3 (+ offload)",
    "checkpoint": "DeepSpeed stages 1-3 (save, load, size, consolidation)",
    "activation_checkpointing": "DeepSpeed stages 2-3 + deepspeed.checkpointing, torch FSDP2 + checkpoint_wrapper",
    "lora": "DeepSpeed stages 2-3 (peft LoRA on a frozen Hugging Face Llama base)",
    "aio": "DeepSpeed's aio_handle and fio (libaio, io_uring) at the same block size and queue depth (1, 8, 32)",
    "nvme": "ds_strategy CPU offload, DeepSpeed NVMe offload (ZeRO-3, a GPT and one 4x larger)",
    "hybrid": "torch DDP, ds_strategy stage 3 through the per-module hooks (greedy generation)",
    "pipeline": "the 1F1B theory (p-1)/(m+p-1), DeepSpeed's PipelineEngine (same layers and config)",
    "compile": "torch DDP eager and torch.compile(DDP), ds_strategy stages 0, 2, 3 eager (inductor)",
    "moe": "gloo all-to-all; DeepSpeed's MoE layer and engine (ZeRO-2, ep_size 1 and 2)",
    "zeropp": "ds_strategy stage 3 without ZeRO++, DeepSpeed's ZeRO++ (where it runs on CPU)",
    "sequence_parallel": "sp 1 (no sequence parallelism), DeepSpeed's Ulysses DistributedAttention in our engine",
    "per_tensor": "stage 2 with AdamW (Muon at stages 0-3, Adafactor at stage 2; the whole-parameter balance)",
    "qlora": "ZeRO stage 2 on the same 4-bit (nf4) base, the theory of partitioning the frozen base",
}


def _select(names: list[str]) -> list[str]:
    chosen = {ALIASES.get(n.removeprefix("bench_"), n.removeprefix("bench_")) for n in names}
    unknown = chosen - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; known: {', '.join(BENCHMARKS)}")
    return [b for b in BENCHMARKS if not chosen or b in chosen]


def _deepspeed_version() -> str | None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None
    from importlib.metadata import version

    return version("deepspeed")


def write_summary(runs: dict[str, dict[str, Any]], quick: bool) -> dict[str, Any]:
    """summary.json and summary.md from every benchmark's JSON in the results folder (``runs`` adds the wall
    time and error of the ones run now)."""
    from benchmarks.common import machine, markdown_table, results_dir

    out = results_dir()
    # Benchmarks not run now keep the wall time (and error) of the summary of the run that wrote their results.
    earlier_summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    previous = earlier_summary.get("benchmarks", {})
    quick = quick or (not runs and earlier_summary.get("quick", False))  # --summary-only keeps the mark
    summary: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "deepspeed": _deepspeed_version(),
        "quick": quick,
        "benchmarks": {},
    }
    for name in BENCHMARKS:
        earlier = {k: v for k, v in previous.get(name, {}).items() if k in ("wall_s", "error")}
        entry: dict[str, Any] = {"peers": PEERS[name], **runs.get(name, earlier)}
        path = out / f"{name}.json"
        if path.exists() and "error" not in entry:
            payload = json.loads(path.read_text())
            entry["headlines"] = importlib.import_module(f"benchmarks.bench_{name}").headlines(payload)
            entry["results_machine"] = payload.get("machine")
        summary["benchmarks"][name] = entry
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    m = summary["machine"]
    lines = [
        "# Benchmark summary",
        "",
        f"{summary['date']}{' (--quick: smoke-run sizes, not figures to quote)' if quick else ''}; "
        f"{m.get('cpu_model') or m['cpu']}, {m['cores']} cores, {m.get('memory_gib')} GiB, torch {m['torch']}, "
        f"python {m['python']}, DeepSpeed {summary['deepspeed'] or 'not installed'}. "
        "Ratios are ours relative to the peer (speed-up: > 1 is ours faster; step / RSS / size: < 1 is ours "
        "smaller). Each benchmark's own table and plot: NAME.md, NAME.png; raw figures: NAME.json.",
    ]
    for name, entry in summary["benchmarks"].items():
        wall = f", {entry['wall_s']:.0f} s" if "wall_s" in entry else ""
        lines += ["", f"## {name} (beside {entry['peers']}{wall})", ""]
        if "error" in entry:
            lines.append(f"failed: {entry['error']}")
        elif "headlines" in entry:
            lines.append(markdown_table(("figure", "value"), entry["headlines"]))
        else:
            lines.append("no results yet")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true", help="every benchmark at smoke-run sizes")
    parser.add_argument(
        "--results", help="results folder (default benchmarks/results; sets $DS_STRATEGY_BENCH_RESULTS)"
    )
    parser.add_argument("--summary-only", action="store_true", help="rewrite summary.{md,json} from the results")
    args = parser.parse_args(argv)
    if args.results:  # before any benchmark module (or a rank it spawns) asks for the folder
        os.environ["DS_STRATEGY_BENCH_RESULTS"] = os.path.abspath(args.results)
    names = _select(args.names)
    if args.quick:  # smoke runs: ranks forked from a server that imported torch once (benchmarks/common.py)
        os.environ.setdefault("DS_STRATEGY_BENCH_FORKSERVER", "1")
    runs: dict[str, dict[str, Any]] = {}
    for name in [] if args.summary_only else names:
        print(f"=== {name} ===", flush=True)
        start = time.monotonic()
        try:
            importlib.import_module(f"benchmarks.bench_{name}").main(["--quick"] if args.quick else [])
            runs[name] = {}
        except (Exception, SystemExit) as err:  # report it and go on with the next benchmark
            traceback.print_exc()
            runs[name] = {"error": f"{type(err).__name__}: {err}"}
        runs[name]["wall_s"] = time.monotonic() - start
        print(f"=== {name}: {runs[name]['wall_s']:.0f} s{' (FAILED)' if 'error' in runs[name] else ''} ===", flush=True)
    write_summary(runs, args.quick)
    if runs:
        total = sum(r["wall_s"] for r in runs.values())
        print("wall time: " + ", ".join(f"{n} {r['wall_s']:.0f} s" for n, r in runs.items()) + f"; total {total:.0f} s")
    failed = [n for n, r in runs.items() if "error" in r]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
