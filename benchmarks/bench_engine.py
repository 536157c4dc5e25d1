"""End-to-end training step on 2 CPU ranks: our ZeRO stages 0-2 (+ CPU offload) beside torch DDP and,
when installed, DeepSpeed at the same stage and config. GPT-like model (8 layers, d=512, seq 256, micro 4,
~25M params, fp32). Writes benchmarks/results/engine.{json,md,png}.

    python -m benchmarks.bench_engine [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.common import machine, markdown_table, peak_rss_bytes, run_ranks, write_results
from ds_strategy.demo.model import GPT, GPTConfig

WORLD = 2


class LossModel(nn.Module):
    """Wraps the GPT so that ``model(batch)`` returns the loss, as engine(batch) expects."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.gpt.loss(*batch)


def _model_and_batches(shape: dict[str, int], steps: int, rank: int) -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=shape["seq"], n_layer=shape["layers"], n_embd=shape["d"], n_head=8)
    model = LossModel(cfg)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = [torch.randint(0, 256, (shape["micro"], shape["seq"] + 1), generator=gen) for _ in range(steps)]
    return model, [(t[:, :-1], t[:, 1:]) for t in tokens]


def _ds_config(stage: int, offload: bool, micro: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _time_steps(step: Any, batches: list[Any], warmup: int) -> float:
    for b in batches[:warmup]:
        step(b)
    start = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    return (time.perf_counter() - start) / max(1, len(batches) - warmup)


def torch_step(module: nn.Module) -> Callable[[Any], None]:
    """One training step of a torch-wrapped model (DDP, FSDP2) with the engines' optimizer settings."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)

    def step(b: Any) -> None:
        loss = module(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine_step(peer: str, model: nn.Module, config: dict[str, Any]) -> Callable[[Any], None]:
    """One training step of DeepSpeed's or our engine, both built by ``initialize`` from the same config."""
    if peer == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed as lib
    else:
        import ds_strategy as lib  # type: ignore[no-redef]
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(b: Any) -> None:
        loss = engine(b)
        engine.backward(loss)
        engine.step()

    return step


def _run_one(rank: int, world: int, peer: str, stage: int, offload: bool, shape: dict[str, int], steps: int) -> dict:
    warmup = 2
    model, batches = _model_and_batches(shape, steps + warmup, rank)
    if peer == "torch DDP":
        step = torch_step(nn.parallel.DistributedDataParallel(model))
    else:
        step = engine_step(peer, model, _ds_config(stage, offload, shape["micro"]))
    seconds = _time_steps(step, batches, warmup)
    params = sum(p.numel() for p in model.parameters())
    return {"seconds_per_step": seconds, "peak_rss": peak_rss_bytes(), "params": params}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model and 3 steps (smoke run)")
    args = parser.parse_args(argv)
    shape = {"layers": 8, "d": 512, "seq": 256, "micro": 4}
    steps = 5
    if args.quick:
        shape, steps = {"layers": 2, "d": 128, "seq": 64, "micro": 2}, 3
    peers = ["ds_strategy"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") else [])
    cases: list[tuple[str, int, bool]] = [("torch DDP", 0, False)]
    for peer in peers:
        cases += [(peer, 0, False), (peer, 1, False), (peer, 2, False), (peer, 2, True)]
    labelled = [(peer if peer == "torch DDP" else f"{peer} stage {st}{' + offload' if off else ''}", peer, st, off)
                for peer, st, off in cases]  # fmt: skip
    rows, records = run_cases(_run_one, labelled, shape, steps)
    table = markdown_table(("case", "s/step (slowest rank)", "peak RSS GiB (max rank)"), rows)
    params = next((r["ranks"][0]["params"] for r in records if "ranks" in r), None)
    write_results("engine", {"machine": machine(), "shape": shape, "params": params, "cases": records}, table)
    plot_step_and_rss(rows, "engine")
    print(table)


Case = tuple[str, str, int, bool]  # (label, peer, stage, offload)


def run_cases(
    run_one: Callable[..., dict[str, Any]], cases: list[Case], shape: dict[str, int], steps: int
) -> tuple[list[tuple[str, str, str]], list[dict[str, Any]]]:
    """Each case in fresh ranks: table rows (label, s/step of the slowest rank, peak RSS GiB of the largest)
    and JSON records; a peer that cannot run here is reported in both, not fatal."""
    rows, records = [], []
    for label, peer, stage, offload in cases:
        try:
            per_rank = run_ranks(run_one, WORLD, peer, stage, offload, shape, steps)
        except Exception as err:
            print(f"{label}: failed: {err}", flush=True)
            records.append({"case": label, "error": str(err)})
            continue
        sec = max(r["seconds_per_step"] for r in per_rank)
        rss = max(r["peak_rss"] for r in per_rank)
        records.append({"case": label, "peer": peer, "stage": stage, "offload": offload, "ranks": per_rank})
        rows.append((label, f"{sec:.3f}", f"{rss / 2**30:.2f}"))
        print(f"{label}: {sec:.3f} s/step, peak RSS {rss / 2**30:.2f} GiB/rank", flush=True)
    return rows, records


def plot_step_and_rss(rows: list[tuple[str, str, str]], name: str) -> None:
    """Two bar charts side by side (s/step, peak RSS per rank) into benchmarks/results/NAME.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common import RESULTS

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [r[0] for r in rows]
    a.barh(labels, [float(r[1]) for r in rows], color="tab:blue")
    a.set_xlabel("seconds per step (2 ranks, CPU)")
    b.barh(labels, [float(r[2]) for r in rows], color="tab:orange")
    b.set_xlabel("peak RSS per rank (GiB)")
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
