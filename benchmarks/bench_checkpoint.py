"""Checkpoint save / load / consolidation on 2 CPU ranks: ds_strategy beside DeepSpeed (when installed).

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
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine import _model_and_batches
from benchmarks.common import machine, markdown_table, peak_rss_bytes, run_ranks, write_results

WORLD = 2
REPEATS = 3


def _config(stage: int, micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def _engine(peer: str, stage: int, shape: dict[str, int], rank: int) -> tuple[Any, Any]:
    model, batches = _model_and_batches(shape, 1, rank)
    if peer == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed as lib
    else:
        import ds_strategy.runtime as lib  # type: ignore[no-redef]
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=_config(stage, shape["micro"]))
    loss = engine(batches[0])
    engine.backward(loss)
    engine.step()
    return engine, model


def _barrier() -> None:
    torch.distributed.barrier()


def _save_load(rank: int, world: int, peer: str, stage: int, shape: dict[str, int], root: str) -> dict[str, Any]:
    engine, model = _engine(peer, stage, shape, rank)
    saves, loads = [], []
    for i in range(REPEATS):
        _barrier()
        start = time.perf_counter()
        engine.save_checkpoint(root, tag=f"t{i}")
        _barrier()
        saves.append(time.perf_counter() - start)
    for i in range(REPEATS):
        _barrier()
        start = time.perf_counter()
        engine.load_checkpoint(root, tag=f"t{i}")
        _barrier()
        loads.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return {"save_s": sorted(saves)[REPEATS // 2], "load_s": sorted(loads)[REPEATS // 2], "params": params}


def _load_other_world(rank: int, world: int, stage: int, shape: dict[str, int], root: str) -> dict[str, Any]:
    engine, _ = _engine("ds_strategy", stage, shape, rank)
    start = time.perf_counter()
    engine.load_checkpoint(root, tag="t0")
    return {"load_s": time.perf_counter() - start}


def _consolidate(rank: int, world: int, peer: str, root: str) -> dict[str, Any]:
    start = time.perf_counter()
    if peer == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(root, tag="t0")
    else:
        from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

        state = consolidate_fp32_state_dict(root, tag="t0")
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss": peak_rss_bytes(), "entries": len(state)}


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model (smoke run)")
    args = parser.parse_args(argv)
    shape = {"layers": 11, "d": 512, "seq": 256, "micro": 2}
    if args.quick:
        shape = {"layers": 2, "d": 128, "seq": 64, "micro": 2}
    peers = ["ds_strategy"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    rows, records = [], []
    params = None
    for stage in (1, 2):
        for peer in peers:
            label = f"{peer} stage {stage}"
            work = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
            try:
                per_rank = run_ranks(_save_load, WORLD, peer, stage, shape, str(work))
                size = _bytes(work / "t0")
                cons = run_ranks(_consolidate, 1, peer, str(work))[0]
                other = run_ranks(_load_other_world, 1, stage, shape, str(work))[0] if peer == "ds_strategy" else None
            except Exception as err:  # a peer that cannot run here is reported, not fatal
                print(f"{label}: failed: {err}", flush=True)
                records.append({"case": label, "error": str(err)})
                continue
            finally:
                shutil.rmtree(work, ignore_errors=True)
            params = per_rank[0]["params"]
            save = max(r["save_s"] for r in per_rank)
            load = max(r["load_s"] for r in per_rank)
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


def _plot(rows: list[tuple[str, ...]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import RESULTS

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
    fig.savefig(RESULTS / "checkpoint.png", dpi=120)


if __name__ == "__main__":
    main()
