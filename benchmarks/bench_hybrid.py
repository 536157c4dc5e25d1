"""Greedy generation under ZeRO stage 3 on 2 CPU ranks (issue 23, criterion 1): tokens/s of the hybrid
engine (``hybrid_engine.enabled``: the partitioned model gathered once per ``engine.generate`` call) beside
plain stage 3 (every forward of every decoding step gathering each module through the hooks) and torch DDP
(each rank holding the whole model), on the e2e benchmark's GPT.

Model: benchmarks/training.py's SHAPE (8 layers, d 512, block 256: ~25M parameters), fp32. Each rank
generates 64 greedy tokens after its own 32-token prompts (batch 4) with ``GPT.generate`` (a cache of the
attention inputs: each step runs the new token only). Plain stage 3 runs with the e2e benchmark's stage-3
keys (STAGE3); the hybrid engine needs the whole model within ``stage3_max_live_parameters`` (its memory
rule), so it runs with STAGE3 and that key at its default (1e9); ``pin_parameters`` false, so every call
pays its gather. All cases in one set of processes: one untimed warm-up call each, then REPEATS rounds
timing one call of every case in turn (so a change in the machine's load hits every case alike), the best
call per case (and the median); tokens/s is per rank (batch x 64 / seconds of the slower rank). The generated tokens are
compared with DDP's. Writes benchmarks/results/hybrid.{json,md,png}. ``--quick``: QUICK_SHAPE, 8 tokens (smoke run).

``--device cuda``: the same cases on one GPU (world size 1 over NCCL, the GPU synchronised around each
call), written as hybrid_cuda.{json,md,png}. At world size 1 a gather moves nothing between ranks: the
figures measure what the per-module hooks cost each decoding step against one gather per call, which on a
GPU (kernels short, launches and Python per module long) is where plain stage 3 loses most.

    python -m benchmarks.bench_hybrid [--quick] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import machine, markdown_table, results_dir, run_each, synchronize, write_results
from benchmarks.training import QUICK_SHAPE, SHAPE, STAGE3, model_and_batches

WORLD = 2  # CPU ranks; --device cuda runs one
NEW, QUICK_NEW = 64, 8
PROMPT, BATCH, REPEATS = 32, 4, 5
COLUMNS = (
    "case",
    "tokens/s per rank (best)",
    "(median)",
    "s per call (best)",
    "bucket all-gathers per call",
    "tokens = DDP",
)
CASES = (
    "torch DDP",
    "ds_strategy stage 3 (plain hooks)",
    "ds_strategy stage 3 + hybrid engine",
    "ds_strategy stage 3 + hybrid engine, inference_tp_size 2",
)
TP_CASE = CASES[3]  # needs 2 ranks: not in the one-GPU run


def _cases(world: int) -> tuple[str, ...]:
    return CASES if world >= 2 else CASES[:3]


def _config(case: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, **STAGE3}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    if "hybrid engine" in case:
        zero["stage3_max_live_parameters"] = 1_000_000_000  # the memory rule: the whole model may be live
        cfg["hybrid_engine"] = {"enabled": True, "pin_parameters": False, "max_out_tokens": 256}
    if case == TP_CASE:  # the two ranks generate their 8 prompts together, each reading half of every weight
        cfg["hybrid_engine"]["inference_tp_size"] = 2
    return cfg


def _caller(case: str, gpt: torch.nn.Module, prompt: torch.Tensor) -> tuple[Callable[[int], torch.Tensor], Any]:
    """``call(n)``: generate n greedy tokens in ``case``; and the engine (None for DDP)."""
    import ds_strategy

    if case == "torch DDP":
        gpt.to(prompt.device)
        ddp = torch.nn.parallel.DistributedDataParallel(gpt)
        ddp.eval()
        return (lambda n: ddp.module.generate(prompt, n, do_sample=False)), None
    engine, *_ = ds_strategy.initialize(model=gpt, config=_config(case))
    engine.eval()
    return (lambda n: engine.generate(prompt, n, do_sample=False)), engine


def _generate(rank: int, world: int, _item: str, quick: bool, device: str) -> dict[str, Any]:
    """Every case in these processes, timed round-robin (DDP, plain, hybrid, DDP, ...): a machine whose load
    changes during the run slows every case alike."""
    shape = QUICK_SHAPE if quick else SHAPE
    new = QUICK_NEW if quick else NEW
    prompt = torch.randint(0, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(100 + rank))
    prompt = prompt.to(device)  # the engines place the model where they run (the current CUDA device)
    callers = {}
    for case in _cases(world):
        model, _ = model_and_batches(shape, 0, rank)  # seed 0: the same weights in every case
        callers[case] = _caller(case, model.gpt, prompt)
        callers[case][0](2)  # warm-up: allocator, kernels, the host pool
    times: dict[str, list[float]] = {case: [] for case in callers}
    gathers: dict[str, int] = {}
    tokens: dict[str, list[Any]] = {}
    for _ in range(REPEATS):
        for case, (call, engine) in callers.items():
            before = engine.stage.gatherer.gathers if engine is not None else 0
            torch.distributed.barrier()
            synchronize(device)
            start = time.perf_counter()
            out = call(new)
            synchronize(device)
            times[case].append(time.perf_counter() - start)
            if engine is not None:
                gathers[case] = engine.stage.gatherer.gathers - before
            tokens[case] = out.tolist()
    for _, engine in callers.values():
        if engine is not None:
            engine.destroy()
    return {
        case: {"seconds": min(times[case]), "all_seconds": times[case], "tokens": tokens[case],
               "gathers_per_call": gathers.get(case)}
        for case in callers
    }  # fmt: skip


def run(quick: bool, device: str = "cpu", world: int | None = None) -> dict[str, Any]:
    """Every case on ``world`` ranks (default: 2 on the CPU over gloo, 1 on the GPU over NCCL)."""
    new = QUICK_NEW if quick else NEW
    world = world if world is not None else (1 if device == "cuda" else WORLD)
    backend = "nccl" if device == "cuda" else "gloo"
    records = []
    for _, result in run_each(_generate, world, ["all cases"], quick, device, backend=backend):
        for case in _cases(world):
            if isinstance(result, Exception):
                records.append({"case": case, "error": f"{type(result).__name__}: {result}"})
                continue
            ranks = [r[case] for r in result]
            seconds = max(r["seconds"] for r in ranks)  # the slowest rank sets the pace
            median = statistics.median(max(t) for t in zip(*(r["all_seconds"] for r in ranks), strict=True))
            record = {
                "case": case,
                "seconds_per_call": seconds,
                "tokens_per_s_per_rank": BATCH * new / seconds,
                "median_tokens_per_s_per_rank": BATCH * new / median,
                "gathers_per_call": ranks[0]["gathers_per_call"],
                "ranks": [{"all_seconds": r["all_seconds"]} for r in ranks],
                "tokens": [r["tokens"] for r in ranks],
            }
            records.append(record)
            print(f"{case}: {record['tokens_per_s_per_rank']:.1f} tokens/s per rank", flush=True)
    by = {r["case"]: r for r in records if "error" not in r}
    ddp = by.get(CASES[0])
    for r in by.values():
        r["tokens_equal_ddp"] = ddp is not None and r["tokens"] == ddp["tokens"]
    derived: dict[str, Any] = {}
    plain, hybrid, tp = by.get(CASES[1]), by.get(CASES[2]), by.get(TP_CASE)
    _speedup(derived, "hybrid_speedup_vs_plain_stage3", hybrid, plain)
    _speedup(derived, "ddp_speedup_vs_hybrid", ddp, hybrid)
    _speedup(derived, "tp_speedup_vs_plain_stage3", tp, plain)
    _speedup(derived, "ddp_speedup_vs_tp", ddp, tp)
    for r in records:
        r.pop("tokens", None)
    return {
        "machine": machine(),
        "quick": quick,
        "shape": QUICK_SHAPE if quick else SHAPE,
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "world_size": world,
        "prompt": PROMPT,
        "batch": BATCH,
        "new_tokens": new,
        "repeats": REPEATS,
        "cases": records,
        "derived": derived,
    }


def _speedup(derived: dict[str, Any], name: str, faster: dict[str, Any] | None, slower: dict[str, Any] | None) -> None:
    """``derived[name]``: ``faster``'s tokens/s over ``slower``'s, best call (and ``median_<name>``, median
    calls); nothing when either case failed."""
    if faster and slower:
        derived[name] = faster["tokens_per_s_per_rank"] / slower["tokens_per_s_per_rank"]
        derived[f"median_{name}"] = faster["median_tokens_per_s_per_rank"] / slower["median_tokens_per_s_per_rank"]


def table(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["cases"]:
        if "error" in r:
            rows.append((r["case"], "failed", "", "", "", r["error"].strip().splitlines()[-1][:100]))
            continue
        gathers = "" if r["gathers_per_call"] is None else str(r["gathers_per_call"])
        rows.append(
            (r["case"], f"{r['tokens_per_s_per_rank']:.1f}", f"{r['median_tokens_per_s_per_rank']:.1f}",
             f"{r['seconds_per_call']:.2f}", gathers, "yes" if r["tokens_equal_ddp"] else "NO")
        )  # fmt: skip
    d = payload["derived"]
    lines = [
        f"Greedy generation of {payload['new_tokens']} tokens after {payload['prompt']}-token prompts, batch "
        f"{payload['batch']} per rank, {_ranks(payload)}, fp32, GPT {payload['shape']}; best and "
        f"median of {payload['repeats']} calls.",
        "",
        markdown_table(COLUMNS, rows),
    ]
    if "hybrid_speedup_vs_plain_stage3" in d:
        lines += ["", f"Hybrid engine vs plain stage 3: {d['hybrid_speedup_vs_plain_stage3']:.2f}x best, "
                  f"{d['median_hybrid_speedup_vs_plain_stage3']:.2f}x median (target >= 3x)."]  # fmt: skip
    if "ddp_speedup_vs_hybrid" in d:
        lines.append(f"DDP vs hybrid engine: {d['ddp_speedup_vs_hybrid']:.2f}x best, "
                     f"{d['median_ddp_speedup_vs_hybrid']:.2f}x median (target <= 1.2x).")  # fmt: skip
    if "tp_speedup_vs_plain_stage3" in d:
        lines.append(f"Hybrid engine with inference_tp_size 2 vs plain stage 3: {d['tp_speedup_vs_plain_stage3']:.2f}x "
                     f"best, {d['median_tp_speedup_vs_plain_stage3']:.2f}x median; DDP vs it: "
                     f"{d['ddp_speedup_vs_tp']:.2f}x best, {d['median_ddp_speedup_vs_tp']:.2f}x median.")  # fmt: skip
    return "\n".join(lines)


def _ranks(payload: dict[str, Any]) -> str:
    device = payload.get("device", "cpu")
    where = "CPU" if device == "cpu" else device
    return f"{payload['world_size']} {where} rank{'s' if payload['world_size'] > 1 else ''}"


def plot(payload: dict[str, Any], name: str = "hybrid") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in payload["cases"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([r["case"] for r in ok], [r["tokens_per_s_per_rank"] for r in ok], color="tab:blue")
    ax.set_xlabel("tokens/s per rank (greedy, higher is better)")
    ax.set_title(f"Generation of {payload['new_tokens']} tokens under ZeRO stage 3, {_ranks(payload)}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(results_dir() / f"{name}.png", dpi=120)
    plt.close(fig)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md."""
    out = []
    d = payload.get("derived", {})
    if "hybrid_speedup_vs_plain_stage3" in d:
        out.append(("hybrid engine vs plain stage 3: tokens/s", f"{d['hybrid_speedup_vs_plain_stage3']:.2f}x"))
    if "ddp_speedup_vs_hybrid" in d:
        out.append(("torch DDP vs hybrid engine: tokens/s", f"{d['ddp_speedup_vs_hybrid']:.2f}x"))
    if "tp_speedup_vs_plain_stage3" in d:
        out.append(("hybrid engine, inference_tp_size 2, vs plain stage 3: tokens/s",
                    f"{d['tp_speedup_vs_plain_stage3']:.2f}x"))  # fmt: skip
    for r in payload.get("cases", []):
        if "error" not in r:
            out.append((f"{r['case']}: tokens/s per rank", f"{r['tokens_per_s_per_rank']:.1f}"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny GPT and 8 tokens, every case in one set of processes"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU, written as hybrid_cuda.*"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: no CUDA device here (torch {torch.__version__}); run it on a GPU machine")
    name = "hybrid" if args.device == "cpu" else "hybrid_cuda"
    payload = run(args.quick, args.device)
    text = table(payload)
    write_results(name, payload, text)
    plot(payload, name)
    print(text)


if __name__ == "__main__":
    main()
