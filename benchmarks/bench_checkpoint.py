"""Checkpoint save / load / consolidation on 2 CPU ranks: ds_strategy beside DeepSpeed (when installed), at
ZeRO stages 1, 2 and 3 (stage 3 with the end-to-end benchmark's stage3_* keys).

GPT-like model (11 layers, d=512, seq 256, ~35M params, fp32, AdamW), one training step so the optimizer
state exists, then per case: save time (every rank; ours fsyncs every file, DeepSpeed does not), bytes
on disk, load time into the same engine, and consolidation to one fp32 state dict in a fresh process
(time and peak RSS). Ours also loads the 2-rank checkpoint at 1 rank (no conversion step; DeepSpeed needs
its offline universal-checkpoint conversion for that). Writes benchmarks/results/checkpoint.{json,md,png}.

    python -m benchmarks.bench_checkpoint [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, markdown_table, peak_rss_bytes, results_dir, run_each, write_results
from benchmarks.training import QUICK_SHAPE, build_engine, ds_config, model_and_batches

WORLD = 2
REPEATS = 3
STAGES = (1, 2, 3)


def _engine(peer: str, stage: int, shape: dict[str, int], rank: int) -> tuple[Any, int]:
    """The engine after one training step, and the model's parameter count (counted before stage 3
    partitions the parameters)."""
    model, batches = model_and_batches(shape, 1, rank)
    params = sum(p.numel() for p in model.parameters())
    engine = build_engine(peer, model, ds_config(stage, False, shape["micro"]))
    loss = engine(batches[0])
    engine.backward(loss)
    engine.step()
    return engine, params


def _barrier() -> None:
    torch.distributed.barrier()


Case = tuple[str, int]  # (peer, stage)


def _dir(root: str, case: Case) -> str:
    return str(Path(root) / f"{case[0]}-{case[1]}")


def _median_seconds(action: Callable[[str], Any]) -> float:
    """Median over REPEATS of ``action(tag)`` for tags t0, t1, ...; every rank starts and ends together."""
    seconds = []
    for i in range(REPEATS):
        _barrier()
        start = time.perf_counter()
        action(f"t{i}")
        _barrier()
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[REPEATS // 2]


def _save_load(rank: int, world: int, case: Case, shape: dict[str, int], root: str) -> dict[str, Any]:
    engine, params = _engine(*case, shape, rank)
    root = _dir(root, case)
    save = _median_seconds(lambda tag: engine.save_checkpoint(root, tag=tag))
    load = _median_seconds(lambda tag: engine.load_checkpoint(root, tag=tag))
    return {"save_s": save, "load_s": load, "params": params}


def _load_other_world(rank: int, world: int, case: Case, shape: dict[str, int], root: str) -> dict[str, Any]:
    engine, _ = _engine(*case, shape, rank)
    start = time.perf_counter()
    engine.load_checkpoint(_dir(root, case), tag="t0")
    return {"load_s": time.perf_counter() - start}


def _consolidate(rank: int, world: int, case: Case, root: str) -> dict[str, Any]:
    root = _dir(root, case)
    start = time.perf_counter()
    if case[0] == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(root, tag="t0")
    else:
        from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

        state = consolidate_fp32_state_dict(root, tag="t0")
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss": peak_rss_bytes(), "entries": len(state)}


def _one_rank(rank: int, world: int, job: tuple[str, Case], shape: dict[str, int], root: str) -> dict[str, Any]:
    """A 1-rank job on a saved checkpoint: "consolidate" it, or "load" it at 1 rank."""
    what, case = job
    if what == "consolidate":
        return _consolidate(rank, world, case, root)
    return _load_other_world(rank, world, case, shape, root)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model (smoke run)")
    args = parser.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else {"layers": 11, "d": 512, "seq": 256, "micro": 2}
    peers = ["ds_strategy"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    cases = [(peer, stage) for stage in STAGES for peer in peers]
    fresh = not args.quick  # smoke runs: every case in one set of processes per phase
    work = tempfile.mkdtemp(prefix="bench_ckpt_")
    try:
        saved = dict(run_each(_save_load, WORLD, cases, shape, work, fresh=fresh))
        sizes = {c: _bytes(Path(_dir(work, c)) / "t0") for c, r in saved.items() if not isinstance(r, Exception)}
        done = [c for c in cases if c in sizes]
        jobs = [("consolidate", c) for c in done] + [("load", c) for c in done if c[0] == "ds_strategy"]
        one_rank = dict(run_each(_one_rank, 1, jobs, shape, work, fresh=fresh))
        consolidated = {c: r for (what, c), r in one_rank.items() if what == "consolidate"}
        other_world = {c: r for (what, c), r in one_rank.items() if what == "load"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, records = [], []
    params = None
    for case in cases:
        peer, stage = case
        label = f"{peer} stage {stage}"
        per_rank, cons, other = saved[case], consolidated.get(case), other_world.get(case)
        error = next((r for r in (per_rank, cons, other) if isinstance(r, Exception)), None)
        if error is not None:  # a peer that cannot run here is reported, not fatal
            print(f"{label}: failed: {error}", flush=True)
            records.append({"case": label, "peer": peer, "stage": stage, "error": str(error)})
            continue
        assert isinstance(per_rank, list) and cons is not None
        cons = cons[0]
        other = other[0] if isinstance(other, list) else None
        params = per_rank[0]["params"]
        save = max(r["save_s"] for r in per_rank)
        load = max(r["load_s"] for r in per_rank)
        size = sizes[case]
        record = {"case": label, "peer": peer, "stage": stage, "ranks": per_rank, "bytes": size}
        record.update({"consolidate": cons, "load_at_1_rank": other})
        records.append(record)
        rows.append(
            (
                label,
                f"{save:.2f}",
                f"{load:.2f}",
                f"{size / 2**20:.0f}",
                f"{other['load_s']:.2f}" if other else "needs offline conversion",
                f"{cons['seconds']:.2f}",
                f"{cons['peak_rss'] / 2**20:.0f}",
            )
        )
        print(" | ".join(rows[-1]), flush=True)
    columns = (
        "case (2 ranks)",
        "save s",
        "load s",
        "MiB on disk",
        "load at 1 rank s",
        "consolidate s",
        "consolidate peak RSS MiB",
    )
    table = markdown_table(columns, rows)
    note = (
        f"\n\n{params} parameters, fp32, AdamW; median of {REPEATS} saves/loads, slowest rank. "
        "Timed on a shared 2-core machine (other jobs running): read trends, not absolutes. "
        "ds_strategy fsyncs every file (durability); DeepSpeed does not."
    )
    write_results(
        "checkpoint", {"machine": machine(), "shape": shape, "params": params, "cases": records}, table + note
    )
    _plot(rows)
    print(table + note)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md: ours over DeepSpeed at each stage (our own
    seconds and bytes where DeepSpeed did not run)."""
    ok = {(r["peer"], r["stage"]): r for r in payload.get("cases", []) if "error" not in r}
    out = []
    for stage in STAGES:
        ours, ds = ok.get(("ds_strategy", stage)), ok.get(("deepspeed", stage))
        if ours and not ds:
            other = ours.get("load_at_1_rank")
            save, load = (max(r[k] for r in ours["ranks"]) for k in ("save_s", "load_s"))
            text = (
                f"save {save:.2f} s, load {load:.2f} s, {ours['bytes'] / 2**20:.0f} MiB, "
                f"consolidate {ours['consolidate']['seconds']:.2f} s"
                + (f", load at 1 rank {other['load_s']:.2f} s" if other else "")
            )
            out.append((f"ds_strategy stage {stage} (DeepSpeed not installed)", text))
            continue
        if not (ours and ds):
            continue
        figures = {
            "save": (max(r["save_s"] for r in ours["ranks"]), max(r["save_s"] for r in ds["ranks"])),
            "load": (max(r["load_s"] for r in ours["ranks"]), max(r["load_s"] for r in ds["ranks"])),
            "bytes on disk": (ours["bytes"], ds["bytes"]),
            "consolidate": (ours["consolidate"]["seconds"], ds["consolidate"]["seconds"]),
        }
        text = ", ".join(f"{k} {a / b:.2f}x" for k, (a, b) in figures.items())
        out.append((f"ds_strategy stage {stage} vs DeepSpeed (ours / theirs)", text))
    return out


def _plot(rows: list[tuple[str, ...]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [r[0] for r in rows]
    for ax, col, title, color in zip(
        axes,
        (1, 2, 3),
        ("save (s)", "load (s)", "bytes on disk (MiB)"),
        ("tab:blue", "tab:green", "tab:orange"),
        strict=True,
    ):
        ax.barh(labels, [float(r[col]) for r in rows], color=color)
        ax.set_xlabel(title)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(results_dir() / "checkpoint.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
