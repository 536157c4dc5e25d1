"""ZeRO stage 3 on 2 CPU ranks: ours with and without parameter offload beside our stage 2, torch DDP,
torch FSDP2 (``fully_shard`` per block) and, when installed, DeepSpeed stage 3, on the engine benchmark's
GPT (8 layers, d=512, seq 256, micro 4, fp32, AdamW). Every stage-3 peer gets the same stage3_* keys.
Writes benchmarks/results/zero3.{json,md,png} (or NAME.* with --name).

    python -m benchmarks.bench_zero3 [--quick] [--only "case,case"] [--name NAME]

glibc's malloc keeps freed multi-MiB blocks resident once its dynamic mmap threshold has grown, which
inflates the peak RSS of every peer (most of all the ones that free and re-allocate, like any stage 3).
Run it a second time with ``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=1048576`` in the
environment (``--name zero3_malloc_pinned``) to see live memory; the settings are recorded in the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from torch import nn

from benchmarks.bench_engine import (
    _model_and_batches,
    _time_steps,
    engine_step,
    plot_step_and_rss,
    run_cases,
    torch_step,
)
from benchmarks.common import machine, markdown_table, peak_rss_bytes, run_ranks, write_results

WORLD = 2
STAGE3 = {  # the model has ~25M parameters; a block ~3.1M, its largest Linear ~1M
    "stage3_prefetch_bucket_size": 1_500_000,  # the next Linear or attention ahead
    "stage3_max_live_parameters": 3_000_000,
    "stage3_max_reuse_distance": 0,
    "stage3_param_persistence_threshold": 10_000,
}


def _config(stage: int, offload: bool, micro: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(STAGE3)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _run_one(rank: int, world: int, peer: str, stage: int, offload: bool, shape: dict[str, int], steps: int) -> dict:
    warmup = 2
    model, batches = _model_and_batches(shape, steps + warmup, rank)
    params = sum(p.numel() for p in model.parameters())
    if peer == "torch DDP":
        step = torch_step(nn.parallel.DistributedDataParallel(model))
    elif peer == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.gpt.blocks:
            fully_shard(block)
        step = torch_step(fully_shard(model))
    else:
        step = engine_step(peer, model, _config(stage, offload, shape["micro"]))
    seconds = _time_steps(step, batches, warmup)
    return {"seconds_per_step": seconds, "peak_rss": peak_rss_bytes(), "params": params}


def _paired(rank: int, world: int, shape: dict[str, int], steps: int) -> dict[str, list[float]]:
    """Stage 2, stage 3 and stage 3 + offload engines in the same processes, their steps interleaved, so
    load from other work on a shared machine hits all three alike; per-step seconds for each."""
    import time

    import ds_strategy.runtime as rt

    cases = {"stage 2": (2, False), "stage 3": (3, False), "stage 3 + offload": (3, True)}
    engines, batches = {}, []
    for label, (stage, offload) in cases.items():
        model, batches = _model_and_batches(shape, steps + 2, rank)
        engines[label] = rt.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage, offload, shape["micro"])
        )[0]
    times: dict[str, list[float]] = {label: [] for label in cases}
    for i, b in enumerate(batches):
        for label, engine in engines.items():
            start = time.perf_counter()
            loss = engine(b)
            engine.backward(loss)
            engine.step()
            if i >= 2:
                times[label].append(time.perf_counter() - start)
    return times


def paired_main(shape: dict[str, int], steps: int, name: str) -> None:
    import statistics

    per_rank = run_ranks(_paired, WORLD, shape, steps)
    labels = list(per_rank[0])
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k]))] for k in labels}
    rows = []
    for k in labels:
        ratio = statistics.median(a / b for a, b in zip(slowest[k], slowest["stage 2"], strict=True))
        rows.append(
            (f"ds_strategy {k}", f"{min(slowest[k]):.3f}", f"{statistics.median(slowest[k]):.3f}", f"{ratio:.3f}")
        )
        print(rows[-1], flush=True)
    table = markdown_table(("case (interleaved)", "min s/step", "median s/step", "median ratio to stage 2"), rows)
    write_results(name, {"machine": machine(), "shape": shape, "stage3_keys": STAGE3, "steps": slowest}, table)
    print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model and 3 steps (smoke run)")
    parser.add_argument("--only", default="", help="comma-separated case labels to run")
    parser.add_argument("--name", default="zero3", help="results file name (benchmarks/results/NAME.*)")
    parser.add_argument("--paired", type=int, default=0, help="interleave stage 2/3/3+offload for N steps")
    args = parser.parse_args(argv)
    shape = {"layers": 8, "d": 512, "seq": 256, "micro": 4}
    steps = 5
    if args.quick:
        shape, steps = {"layers": 2, "d": 128, "seq": 64, "micro": 2}, 3
    if args.paired:
        paired_main(shape, args.paired, args.name)
        return
    cases: list[tuple[str, str, int, bool]] = [
        ("torch DDP", "torch DDP", 0, False),
        ("torch FSDP2", "torch FSDP2", 3, False),
        ("ds_strategy stage 2", "ds_strategy", 2, False),
        ("ds_strategy stage 3", "ds_strategy", 3, False),
        ("ds_strategy stage 3 + offload", "ds_strategy", 3, True),
    ]
    if importlib.util.find_spec("deepspeed"):
        cases += [("deepspeed stage 3", "deepspeed", 3, False), ("deepspeed stage 3 + offload", "deepspeed", 3, True)]
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    rows, records = run_cases(_run_one, [c for c in cases if not only or c[0] in only], shape, steps)
    table = markdown_table(("case", "s/step (slowest rank)", "peak RSS GiB (max rank)"), rows)
    params = next((r["ranks"][0]["params"] for r in records if "ranks" in r), None)
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    payload = {
        "machine": machine(),
        "shape": shape,
        "params": params,
        "stage3_keys": STAGE3,
        "malloc_env": malloc,
        "cases": records,
    }
    write_results(args.name, payload, table)
    plot_step_and_rss(rows, args.name)
    print(table)


if __name__ == "__main__":
    main()
