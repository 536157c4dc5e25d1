"""``python -m benchmarks.bench_fetch_cost``: the host's cost of one stage-3 fetch (Python + launches), beside
FSDP2's, on a compute-free model of 64 blocks (each a 16x16 Linear and a LayerNorm), one CPU process.

Cases: ``plain`` (the model unsharded: the floor), ``torch FSDP2`` (``fully_shard`` per block and on the
root), ``zero3`` (``ds_strategy.initialize``, stage 3, default fetch units), ``zero3 modules`` (per-module
units: the previous design), each at world size 1 (gloo) and at world size 8 under torch's fake process
group (collectives launched, nothing moved). A step is forward, backward, optimizer step and zero_grad, so
the difference to ``plain`` over the fetches of a step (64 blocks x forward and backward, plus the root's)
is what each fetch costs the host. Medians of 30 steps after 5 warm-up (``--steps``), with the spread of the
timed steps (slowest / fastest) and the collector's full (generation 2) passes among them: a host-bound step
that leaves objects behind makes them frequent and long (tests/runtime/test_step_leaks.py). Writes
benchmarks/results/fetch_cost.{json,md,png}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import free_port, machine, markdown_table, results_dir, write_results

BLOCKS, WIDTH, STEPS, WARMUP = 64, 16, 30, 5
CASES = ["plain", "torch FSDP2", "zero3", "zero3 modules"]


def _model() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.fc = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(self.norm(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(WIDTH, WIDTH)
            self.blocks = nn.ModuleList([Block() for _ in range(BLOCKS)])
            self.out = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h).square().mean()

    torch.manual_seed(0)
    return Net()


def run_case(case: str, world: int, steps: int = STEPS) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    model = _model()
    x = torch.randn(4, WIDTH)
    if case.startswith("zero3"):
        import ds_strategy

        zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
        if case == "zero3 modules":
            zero["stage3_fetch_units"] = "modules"
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": zero,
        }
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)

        def step() -> None:
            loss = engine(x)
            engine.backward(loss)
            engine.step()

        gatherer = engine.stage.gatherer
    else:
        if case == "torch FSDP2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

        def step() -> None:
            loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        gatherer = None
    times, full_passes = [], []

    def count_full_passes(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2 and len(times) >= WARMUP:
            full_passes.append(len(times))

    gc.callbacks.append(count_full_passes)
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    gc.callbacks.remove(count_full_passes)
    timed = times[WARMUP:]
    out = {
        "ms": 1e3 * statistics.median(timed),
        "world": world,
        "spread": max(timed) / min(timed),
        "full_gc_passes": len(full_passes),
    }
    if gatherer is not None:
        out["gathers_per_step"] = gatherer.gathers / (WARMUP + steps)
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,8")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case, args.world, args.steps)))
        return
    records = []
    for world in (int(w) for w in args.worlds.split(",")):
        for case in [c for c in args.cases.split(",") if c]:
            cmd = [sys.executable, "-m", "benchmarks.bench_fetch_cost", "--case", case, "--world", str(world)]
            cmd += ["--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                records.append({"case": case, "world": world, "error": proc.stderr[-2000:]})
                print(f"{case} world {world}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            record = {"case": case, **json.loads(proc.stdout.strip().splitlines()[-1])}
            records.append(record)
            print(f"{case} world {world}: {record['ms']:.2f} ms/step", flush=True)
    fetches = 2 * BLOCKS + 2  # every block in forward and backward, and the root (rest) unit twice
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["case"], r["world"], "failed", "", "", "", ""])
            continue
        floor = next(
            (p["ms"] for p in records if p["case"] == "plain" and p["world"] == r["world"] and "ms" in p), None
        )
        per = "" if floor is None or r["case"] == "plain" else f"{1e3 * (r['ms'] - floor) / fetches:.1f}"
        gathers = r.get("gathers_per_step")
        rows.append([
            r["case"], r["world"], f"{r['ms']:.2f}", per, "" if gathers is None else f"{gathers:.1f}",
            f"{r['spread']:.2f}", r["full_gc_passes"],
        ])  # fmt: skip
    head = ["case", "world size", "ms / step", "host us per fetch", "all-gathers / step", "max / min step"]
    text = markdown_table([*head, "full GC passes"], rows)
    text += (
        f"\n\n{BLOCKS} blocks of a {WIDTH}x{WIDTH} Linear and a LayerNorm: no compute to speak of, so a step is the "
        f"host's work. 'host us per fetch' = (ms/step - plain's) / {fetches} fetches (each block in forward and "
        "backward, the root twice). World size 8: torch's fake process group (launches, no data). "
        f"{args.steps} timed steps after {WARMUP} warm-up; 'full GC passes': Python's generation-2 collections "
        "during them."
    )
    write_results("fetch_cost", {"machine": machine(), "blocks": BLOCKS, "records": records}, text)
    _plot(records)
    print(text)


def _plot(records: list[dict[str, Any]]) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "ms" in r]
    labels = [f"{r['case']} (W={r['world']})" for r in ok][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(ok) + 1.4))
    ax.barh(labels, [r["ms"] for r in ok][::-1], color=["tab:blue" if "zero3" in lbl else "tab:gray" for lbl in labels])
    ax.set_xlabel(f"ms per step, {BLOCKS} compute-free blocks (host work only), lower is better")
    fig.tight_layout()
    fig.savefig(results_dir() / "fetch_cost.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
