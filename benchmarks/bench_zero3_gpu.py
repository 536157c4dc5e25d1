"""``python -m benchmarks.bench_zero3_gpu``: stage 3 against a plain step, torch FSDP2 and DeepSpeed's stage 3,
as a new user runs them: a Hugging Face ``LlamaForCausalLM`` built from a config, ``precision="bf16-mixed"``,
``torch.optim.AdamW``, through ``Trainer(strategy=...)`` (FSDP2: ``fully_shard`` per block with
``MixedPrecisionPolicy(bf16)``, in a plain loop, as its users write it). Issue 41's table.

Cases (each in a fresh process; ``--only`` picks some):
* ``auto``: one device, no ZeRO (Lightning's default strategy);
* ``torch FSDP2``: world size 1;
* ``zero3``: ``Trainer(strategy="zero3")``, world size 1;
* ``zero3 fake-8``: the same under torch's fake process group of world size 8 (one process runs what each
  of 8 ranks runs: compute, our host work, collective launches, its memory; no data moves);
* ``deepspeed_stage_3``: Lightning's DeepSpeedStrategy, when DeepSpeed is installed (GPU only).

Per case: the median step time after warm-up, the spread (max / min), ``max_memory_allocated`` (GPU) or peak
RSS (CPU), the losses of the first steps (equal across cases at world size 1). ``--device cuda`` (default
when a GPU is there) uses the ~271M shape of the issue (hidden 1024, 16 layers, batch 8 x 1024); ``--device
cpu`` or ``--quick`` a small one. ``--trace`` also writes a torch.profiler trace of one step of the zero3
case (NAME_trace.json.gz) and its timeline picture (NAME_timeline.png: compute, gather and reduce streams),
and of the other Lightning cases (NAME_CASE_trace.json.gz, NAME_CASE_timeline.png) to compare with.
``--sample`` samples every thread's Python stack (benchmarks/stack_sampler.py) over 10 steps before the
last few of each Lightning case, which are then not timed, into NAME_stacks_CASE.txt: where the host's time
goes, the autograd thread's hooks included.
Results: benchmarks/results/NAME.{json,md,png} (NAME: zero3_gpu, or zero3_cpu on the CPU).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    free_port,
    machine,
    markdown_table,
    peak_memory_bytes,
    results_dir,
    synchronize,
    write_results,
)

GPU_SHAPE = {"hidden": 1024, "layers": 16, "intermediate": 2816, "vocab": 32000, "heads": 16, "micro": 8, "seq": 1024}
# CPU: the plumbing and the host work per step, not throughput: few tokens, so a step is mostly host time;
# hidden 320 keeps every block matrix above stage3_param_persistence_threshold (1e5), so each block is a unit.
CPU_SHAPE = {"hidden": 320, "layers": 4, "intermediate": 864, "vocab": 2000, "heads": 4, "micro": 2, "seq": 64}
CASES = ["auto", "torch FSDP2", "zero3", "zero3 fake-8", "deepspeed_stage_3"]
FAKE_WORLD = 8
WARMUP = 5


# ---- one case, in its own process ------------------------------------------------------------------------
def _llama(shape: dict[str, int]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        intermediate_size=shape["intermediate"],
        vocab_size=shape["vocab"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=shape["seq"],
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _batches(shape: dict[str, int], steps: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, shape["vocab"], (shape["micro"], shape["seq"]), generator=gen) for _ in range(steps)]


def _fake_group(world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


SAMPLED = 10  # steps under the stack sampler (--sample)


def _lightning_case(
    case: str, shape: dict[str, int], steps: int, device: str, trace: Path | None, stacks: Path | None = None
) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    if case == "zero3 fake-8":
        _fake_group(FAKE_WORLD)
    if case.startswith("zero3"):
        import ds_strategy  # noqa: F401  - registers "zero3"

    batches = _batches(shape, steps)
    times: list[float] = []
    losses: list[float] = []
    stats: dict[str, Any] = {}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama(shape)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = self.model(input_ids=batch, labels=batch)
            return out.loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches, batch_size=None)

    # The SAMPLED steps before the last two (fewer in a short run: never the warm-up), not timed.
    sampled = range(max(WARMUP, steps - 2 - SAMPLED), steps - 2) if stacks is not None else range(0)
    gc_ms, mallocs = _GcPerStep(), []  # per step: Python's garbage collection, new allocator segments
    host_ms: list[float] = []  # per step: until the host has issued it (close to the step time: host-bound)

    def segments() -> int:
        return int(torch.cuda.memory_stats().get("segment.all.allocated", 0)) if device == "cuda" else 0

    class Timer(pl.Callback):
        start = 0.0
        sampler: Any = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            # The step number, not batch_idx: a rank of a fake group of 8 sees 1/8 of the batches per epoch.
            step = trainer.global_step
            synchronize(device)
            if step == sampled.start and len(sampled):
                from benchmarks.stack_sampler import StackSampler

                self.sampler = StackSampler().__enter__()
            self.segments = segments()
            gc_ms.begin_step()
            if trace is not None and step == steps - 2:
                self.prof = _profiler(device)
                self.prof.__enter__()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step - 1  # counted once the optimizer stepped
            host_ms.append(round(1e3 * (time.perf_counter() - self.start), 2))  # issued; the device may lag
            synchronize(device)
            gc_ms.end_step()
            mallocs.append(segments() - self.segments)
            profiled = (trace is not None and step == steps - 2) or step in sampled
            if not profiled:  # a profiled step runs slower: not timed
                times.append(time.perf_counter() - self.start)
            if self.sampler is not None and step == sampled.stop - 1:
                self.sampler.__exit__(None, None, None)
                stacks.write_text(f"{case}, steps {sampled.start}..{sampled.stop - 1}\n" + self.sampler.report())
            losses.append(float(outputs["loss"]))  # after the synchronize: no extra wait
            if trace is not None and step == steps - 2:
                self.prof.__exit__(None, None, None)
                self.prof.export_chrome_trace(str(trace))

        def on_train_end(self, trainer: Any, module: Any) -> None:
            engine = getattr(trainer.strategy, "engine", None)  # ours, before teardown releases it
            gatherer = getattr(getattr(engine, "stage", None), "gatherer", None)
            if gatherer is not None:
                stats["world_size"] = engine.coll.world_size
                stats["gathers_per_step"] = gatherer.gathers / max(1, steps)
                stats["fetch_units"] = len({tuple(keys) for keys in gatherer.units.values() if keys})

    strategy: Any = {"auto": "auto"}.get(case, "zero3")
    if case == "deepspeed_stage_3":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        # The registered name, with the micro batch stated: Lightning reads it from the loader's batch
        # sampler otherwise, and this loader yields ready batches (batch_size=None).
        strategy = DeepSpeedStrategy(stage=3, logging_batch_size_per_gpu=shape["micro"])
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # The same batches in the same order at world size 1 (equal losses across cases); a fake rank of 8
        # takes its share, as it would at that size.
        use_distributed_sampler=case == "zero3 fake-8",
        callbacks=[Timer()],
    )
    module = Module()
    params = sum(p.numel() for p in module.parameters())
    trainer.fit(module)
    gc_ms.close()
    return {
        "times": times,
        "losses": losses,
        "params": params,
        "peak_bytes": peak_memory_bytes(device),
        "gc_ms_steps": [round(t, 2) for t in gc_ms.steps],
        "new_segments_steps": mallocs,
        "host_ms_steps": host_ms,
        **stats,
    }


class _GcPerStep:
    """Milliseconds of Python garbage collection in each step (gc.callbacks): a cause of step-time spread."""

    def __init__(self) -> None:
        import gc

        self.steps: list[float] = []
        self._current = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started:
            self._current += 1e3 * (time.perf_counter() - self._started)

    def begin_step(self) -> None:
        self._current = 0.0

    def end_step(self) -> None:
        self.steps.append(self._current)

    def close(self) -> None:
        import gc

        gc.callbacks.remove(self._on_gc)


def _profiler(device: str) -> Any:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    return profile(activities=acts)


def _fsdp2_case(shape: dict[str, int], steps: int, device: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = _llama(shape).to(dev)
    params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    for b in _batches(shape, steps):
        b = b.to(dev)
        synchronize(device)
        start = time.perf_counter()
        loss = model(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if len(losses) < 8:
            losses.append(float(loss))
    dist.destroy_process_group()
    return {"times": times, "losses": losses, "params": params, "peak_bytes": peak_memory_bytes(device)}


def run_case(
    case: str, shape: dict[str, int], steps: int, device: str, trace: Path | None, stacks: Path | None = None
) -> dict[str, Any]:
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    if case == "torch FSDP2":
        return _fsdp2_case(shape, steps, device)
    return _lightning_case(case, shape, steps, device, trace, stacks)


# ---- the driver ----------------------------------------------------------------------------------------------
def summarize(case: str, raw: dict[str, Any]) -> dict[str, Any]:
    timed = raw["times"][WARMUP:] or raw["times"]
    return {
        "case": case,
        "ms_median": 1e3 * statistics.median(timed),
        "spread": max(timed) / min(timed),
        "peak_gib": raw["peak_bytes"] / 2**30,
        **{k: v for k, v in raw.items() if k not in ("times", "peak_bytes")},
        "ms_steps": [round(1e3 * t, 2) for t in raw["times"]],
    }


def table(records: list[dict[str, Any]], device: str) -> str:
    auto = next((r for r in records if r["case"] == "auto" and "error" not in r), None)
    fsdp = next((r for r in records if r["case"] == "torch FSDP2" and "error" not in r), None)
    memory = "peak allocated GiB" if device == "cuda" else "peak RSS GiB"
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["case"], "failed", "", "", "", "", r["error"].strip().splitlines()[-1][:80]])
            continue
        rows.append(
            [
                r["case"],
                f"{r['ms_median']:.1f}",
                f"{r['spread']:.2f}",
                f"{r['peak_gib']:.2f}",
                f"{r['ms_median'] / auto['ms_median']:.2f}x" if auto else "",
                f"{r['ms_median'] / fsdp['ms_median']:.2f}x" if fsdp else "",
                ", ".join(f"{x:.4f}" for x in r["losses"][:3]),
            ]
        )
    cols = ["case", "ms / step (median)", "max/min", memory, "vs auto", "vs FSDP2", "first losses"]
    return markdown_table(cols, rows)


def plot(records: list[dict[str, Any]], name: str, device: str) -> bool:
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "error" not in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.45 * len(ok) + 1.6))
    labels = [r["case"] for r in ok][::-1]
    colors = ["tab:blue" if r["case"].startswith("zero3") else "tab:gray" for r in ok][::-1]
    a.barh(labels, [r["ms_median"] for r in ok][::-1], color=colors)
    a.set_xlabel("ms per step (median after warm-up), lower is better")
    b.barh(labels, [r["peak_gib"] for r in ok][::-1], color=colors)
    b.set_xlabel(("peak allocated" if device == "cuda" else "peak RSS") + " GiB, lower is better")
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(results_dir() / f"{name}.png", dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--quick", action="store_true", help="the small shape and few steps")
    parser.add_argument("--only", default="", help="comma-separated cases: " + ", ".join(CASES))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--trace", action="store_true", help="profile a step of each Lightning case, draw its streams")
    parser.add_argument("--sample", action="store_true", help="sample the host's Python stacks (Lightning cases)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per case")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, write JSON to --out
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = CPU_SHAPE if device == "cpu" or args.quick else GPU_SHAPE
    steps = args.steps or (12 if args.quick else 40 if device == "cuda" else 20)
    if args.case:
        trace = Path(args.out).with_suffix(".trace.json") if args.trace else None
        stacks = Path(args.out).with_suffix(".stacks.txt") if args.sample else None
        Path(args.out).write_text(json.dumps(run_case(args.case, shape, steps, device, trace, stacks)))
        return
    name = args.name or f"zero3_{'gpu' if device == 'cuda' else 'cpu'}"
    chosen = [c.strip() for c in args.only.split(",") if c.strip()] or [
        c for c in CASES if c != "deepspeed_stage_3" or (device == "cuda" and importlib.util.find_spec("deepspeed"))
    ]
    unknown = set(chosen) - set(CASES)
    if unknown:
        raise SystemExit(f"--only: unknown case(s) {sorted(unknown)}; cases: {CASES}")
    os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    records: list[dict[str, Any]] = []
    for case in chosen:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "case.json"
            cmd = [sys.executable, "-m", "benchmarks.bench_zero3_gpu", "--case", case, "--out", str(out)]
            cmd += ["--device", device, "--steps", str(steps)] + (["--quick"] if args.quick else [])
            cmd += ["--trace"] if args.trace and case != "torch FSDP2" else []
            cmd += ["--sample"] if args.sample and case != "torch FSDP2" else []
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
                ok = proc.returncode == 0 and out.exists()
                error = "" if ok else (proc.stderr or proc.stdout)[-3000:]
            except subprocess.TimeoutExpired:
                ok, error = False, f"timed out after {args.timeout:g} s"
            record = summarize(case, json.loads(out.read_text())) if ok else {"case": case, "error": error}
            slug = case.replace(" ", "_").replace("-", "")
            if ok and args.trace and case != "torch FSDP2":
                _keep_trace(out.with_suffix(".trace.json"), name if case == "zero3" else f"{name}_{slug}")
            if ok and out.with_suffix(".stacks.txt").exists():
                (results_dir() / f"{name}_stacks_{slug}.txt").write_text(out.with_suffix(".stacks.txt").read_text())
        records.append(record)
        shown = f"{record['ms_median']:.1f} ms/step" if ok else f"failed: {error.strip().splitlines()[-1:]}"
        print(f"{case}: {shown}", flush=True)
        text = table(records, device) + ("" if len(records) == len(chosen) else "\n\nPartial run.")
        write_results(
            name, {"machine": machine(), "device": device, "shape": shape, "steps": steps, "cases": records}, text
        )
    plot(records, name, device)
    print(table(records, device))


def _keep_trace(trace: Path, name: str) -> None:
    if not trace.exists():
        return
    dest = results_dir() / f"{name}_trace.json.gz"
    with trace.open("rb") as src, gzip.open(dest, "wb") as out:
        out.write(src.read())
    from benchmarks.timeline import draw_timeline

    draw_timeline(dest, results_dir() / f"{name}_timeline.png")  # every case's: compare the streams' gaps


if __name__ == "__main__":
    main()
