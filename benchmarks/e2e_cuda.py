"""``python -m benchmarks.bench_e2e --device cuda``: the end-to-end training step on one GPU (docs/gpu.md).

ds_strategy stages 2 and 3 beside torch DDP, torch FSDP2 (``fully_shard`` per block) and, when installed,
DeepSpeed stages 2 and 3 with the same config, at world size 1 over NCCL: each case in a fresh process,
2 warm-up steps then timed steps (the GPU synchronised after each), and ``torch.cuda.max_memory_allocated``
over the whole case (model build, engine build, steps). GPT of ds_strategy.demo, fp32, AdamW; a larger
shape than the CPU benchmark's (``CUDA_SHAPE``), ``--quick`` the tiny one. Writes
benchmarks/results/NAME.{json,md,png} (NAME: e2e_cuda unless --name; the folder: $DS_STRATEGY_BENCH_RESULTS).

At world size 1 nothing is partitioned: the figures measure each implementation's per-step overhead and
the memory its buffers cost on one GPU, not ZeRO's savings (those need several GPUs).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    machine,
    markdown_table,
    peak_memory_bytes,
    results_dir,
    run_each,
    synchronize,
    write_results,
)
from benchmarks.training import QUICK_SHAPE, STAGE3, WARMUP, model_and_batches, peer_step

CUDA_SHAPE = {"layers": 12, "d": 768, "seq": 512, "micro": 8}  # ~85M parameters, GPT-2-small-like
STEPS, QUICK_STEPS = 10, 3
WORLD = 1
Case = tuple[str, str, int, bool]  # (label, peer, stage, offload)


def no_cuda_message() -> str | None:
    """The one-line reason ``--device cuda`` cannot run here, or None when it can."""
    if torch.cuda.is_available():
        return None
    return (
        f"bench_e2e --device cuda: no CUDA device here (torch {torch.__version__}, CUDA build "
        f"{torch.version.cuda}); run it on a GPU machine (docs/gpu.md) or use --device cpu"
    )


def cases(with_deepspeed: bool) -> list[Case]:
    out: list[Case] = [("torch DDP", "torch DDP", 0, False), ("torch FSDP2", "torch FSDP2", 3, False)]
    for peer in ("ds_strategy", "deepspeed") if with_deepspeed else ("ds_strategy",):
        out += [(f"{peer} stage {stage}", peer, stage, False) for stage in (2, 3)]
    return out


# ---- one case, in its own process ---------------------------------------------------------------------


def _reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def arch_list_for_deepspeed(current: str | None, capability: tuple[int, int]) -> str | None:
    """The TORCH_CUDA_ARCH_LIST DeepSpeed's JIT op builder can read, or None to leave it as it is.

    DeepSpeed 0.19.8 sorts the entries as integers and fails on an architecture suffix ("9.0a", seen on the
    H200 machine of 2026-11-26: ``invalid literal for int() with base 10: '0a'``); the GPU's own
    capability builds the same FusedAdam for this device."""
    if not current:
        return None
    entries = current.replace(";", " ").split()
    if all(e.removesuffix("+PTX").replace(".", "", 1).isdigit() for e in entries):
        return None
    return f"{capability[0]}.{capability[1]}"


def _run_case(rank: int, world: int, case: Case, shape: dict[str, int], steps: int, device: str) -> dict[str, Any]:
    _, peer, stage, offload = case
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if peer == "deepspeed" and device == "cuda":
        arch = arch_list_for_deepspeed(os.environ.get("TORCH_CUDA_ARCH_LIST"), torch.cuda.get_device_capability(dev))
        if arch is not None:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # this case's own process
    _reset_peak(device)
    model, batches = model_and_batches(shape, steps + WARMUP, rank)
    params = sum(p.numel() for p in model.parameters())
    if peer.startswith("torch"):
        model.to(dev)  # the engines move a CPU-built model themselves (stage 3 bucket by bucket)
    step = peer_step(peer, model, stage, offload, shape["micro"])
    on_device = [tuple(t.to(dev) for t in b) for b in batches]
    synchronize(device)
    for b in on_device[:WARMUP]:
        step(b)
    synchronize(device)
    times = []
    for b in on_device[WARMUP:]:
        start = time.perf_counter()
        step(b)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {
        "seconds_per_step": sum(times) / len(times),
        "min_seconds": min(times),
        "peak_allocated": peak_memory_bytes(device),
        "params": params,
        "device_name": torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
    }


def run(
    case_list: list[Case],
    shape: dict[str, int],
    steps: int,
    device: str = "cuda",
    progress: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every case in a fresh process of its own (world size 1, NCCL on CUDA); a peer that fails is recorded
    with its error. ``progress(records so far)`` after each case."""
    records = []
    backend = "nccl" if device == "cuda" else "gloo"
    for (name, peer, stage, offload), per_rank in run_each(
        _run_case, WORLD, case_list, shape, steps, device, backend=backend
    ):
        record: dict[str, Any] = {"case": name, "peer": peer, "stage": stage, "offload": offload}
        if isinstance(per_rank, Exception):
            print(f"{name}: failed: {per_rank}", flush=True)
            records.append({**record, "error": str(per_rank)})
        else:
            record.update(per_rank[0])
            records.append(record)
            gib = record["peak_allocated"] / 2**30
            print(f"{name}: {record['seconds_per_step'] * 1e3:.1f} ms/step, peak allocated {gib:.2f} GiB", flush=True)
        if progress is not None:
            progress(records)
    return records


# ---- the report -------------------------------------------------------------------------------------------


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> str:
    return f"{a[key] / b[key]:.2f}x" if a and b else "-"


def table(records: list[dict[str, Any]]) -> str:
    ok = {r["case"]: r for r in records if "error" not in r}
    fsdp = ok.get("torch FSDP2")
    rows = []
    for r in records:
        if "error" in r:
            rows.append((r["case"], "failed", "-", "-", "-", "-"))
            continue
        ds = ok.get(f"deepspeed stage {r['stage']}") if r["peer"] == "ds_strategy" else None
        rows.append(
            (
                r["case"], f"{r['seconds_per_step'] * 1e3:.1f}", f"{r['peak_allocated'] / 2**30:.2f}",
                _ratio(r, fsdp, "seconds_per_step"), _ratio(r, ds, "seconds_per_step"), _ratio(r, ds, "peak_allocated"),
            )
        )  # fmt: skip
    columns = ("case", "ms/step", "peak allocated GiB", "step vs FSDP2", "step vs DeepSpeed",
               "memory vs DeepSpeed")  # fmt: skip
    return markdown_table(columns, rows)


def plot(records: list[dict[str, Any]], name: str) -> bool:
    """Two bar charts (ms/step, peak allocated) into NAME.png; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    colors = {"ds_strategy": "tab:blue", "deepspeed": "tab:orange"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.35 * len(ok) + 1.5))
    labels = [r["case"] for r in ok][::-1]
    cols = [colors.get(r["peer"], "tab:gray") for r in ok][::-1]
    a.barh(labels, [r["seconds_per_step"] * 1e3 for r in ok][::-1], color=cols)
    a.set_xlabel("ms per step (one GPU), lower is better")
    b.barh(labels, [r["peak_allocated"] / 2**30 for r in ok][::-1], color=cols)
    b.set_xlabel("peak allocated (GiB), lower is better")
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(results_dir() / f"{name}.png", dpi=120)
    plt.close(fig)
    return True


def main(quick: bool, only: set[str], name: str, device: str = "cuda") -> None:
    """``--device cuda`` of bench_e2e (``device="cpu"``: the same plumbing on the CPU, for the tests)."""
    if device == "cuda":
        reason = no_cuda_message()
        if reason is not None:
            raise SystemExit(reason)
        # benchmarks/__init__.py points DeepSpeed at its CPU accelerator; here it (and ours) take the GPU.
        # Set before the case processes are spawned: they inherit it.
        os.environ["DS_ACCELERATOR"] = "cuda"
    shape, steps = (QUICK_SHAPE, QUICK_STEPS) if quick else (CUDA_SHAPE, STEPS)
    all_cases = cases(importlib.util.find_spec("deepspeed") is not None)
    unknown = only - {c[0] for c in all_cases}
    if unknown:
        raise SystemExit(f"--only: unknown case(s) {sorted(unknown)}; cases: {[c[0] for c in all_cases]}")
    chosen = [c for c in all_cases if not only or c[0] in only]

    def report(records: list[dict[str, Any]]) -> str:
        """Write NAME.{json,md}: after every case (a run stopped by a time limit keeps the cases it finished)
        and at the end."""
        text = table(records)
        if len(records) < len(chosen):
            text += f"\n\nPartial: {len(records)} of {len(chosen)} cases so far."
        text += (
            "\n\nOne GPU, world size 1 over NCCL: nothing is partitioned, so this is per-step overhead and buffer "
            "memory, not ZeRO's saving."
        )
        write_results(name, _payload(records, shape, steps, device), text)
        return text

    records = run(chosen, shape, steps, device, progress=report)
    text = report(records)
    if not plot(records, name):
        print(f"matplotlib is not installed: no {name}.png", flush=True)
    print(text)


def _payload(records: list[dict[str, Any]], shape: dict[str, int], steps: int, device: str) -> dict[str, Any]:
    return {
        "machine": machine(),
        "device": device,
        "gpu": next((r["device_name"] for r in records if "device_name" in r), None),
        "shape": shape,
        "world_size": WORLD,
        "stage3_keys": STAGE3,
        "steps": steps,
        "params": next((r["params"] for r in records if "params" in r), None),
        "cases": records,
    }
