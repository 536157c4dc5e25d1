"""``python -m ds_strategy.demo``: ZeRO stage 3 on 2 CPU processes, beside ZeRO stage 2 and DDP.

1. ``Trainer(strategy="zero3", accelerator="cpu", devices=2)`` trains a small GPT (byte-level) on the
   documentation topics that ship with Python (``pydoc_data``), with Lightning's progress bar, and saves a
   sharded checkpoint at the end of training (``trainer.save_checkpoint`` from a callback, while the engine
   still holds the partitions).
2. The same model, data and seed train briefly under ``"zero2"`` and Lightning's ``"ddp"``.
3. Rank 0 prints a table per strategy: loss (first, last, largest gap to DDP), tokens/s, and each rank's
   peak memory, measured on that rank and all-gathered (demo/measure.py); writes a PNG of the loss curves
   and the memory per rank.
4. ``ds-zero-to-fp32`` consolidates the zero3 checkpoint into one fp32 state dict, which a bare ``GPT``
   (plain torch, no strategy) loads; its weights are compared with the trained ones and it writes a sample.

The three fits share two processes: the first Trainer re-runs this command as rank 1 (Lightning's
subprocess launcher), and every later Trainer finds the ranks and the process group already there.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import lightning as L
from ds_strategy.demo.data import VOCAB_SIZE, CharDataset, corpus_text, decode
from ds_strategy.demo.measure import RunRecorder, RunResult, measured_peak_flops, training_flops_per_token
from ds_strategy.demo.model import GPT, GPTConfig
from ds_strategy.demo.module import GPTModule
from ds_strategy.profiling import peak_flops, set_peak_tflops

PROMPT = "The "
CHECKPOINT = "zero3.ckpt"  # a directory: ZeroStrategy checkpoints are sharded
CONSOLIDATED = "zero3_fp32.pt"
PLOT = "demo.png"
FLOPS_PROFILE = "flops_profile.txt"  # the engine's flops profile of one zero3 step (flops_profiler.output_file)


@dataclass(frozen=True)
class Plan:
    """Model size and run lengths; ``--quick`` shrinks everything to a smoke test."""

    model: GPTConfig
    zero3_steps: int
    brief_steps: int  # zero2 and ddp
    batch_size: int
    lr: float
    max_chars: int | None = None  # corpus prefix (None: all of it)
    sample_chars: int = 200


FULL = Plan(  # 10.7M parameters: model states (16 bytes each) outweigh what every rank holds anyway
    model=GPTConfig(vocab_size=VOCAB_SIZE, block_size=128, n_layer=6, n_head=8, n_embd=384),
    zero3_steps=150,
    brief_steps=25,
    batch_size=4,
    lr=1e-3,
    sample_chars=120,  # the prompt and the sample fit block_size: decoding runs on the key/value cache
)
QUICK = Plan(
    model=GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=1, n_head=2, n_embd=32),
    zero3_steps=3,
    brief_steps=2,
    batch_size=4,
    lr=3e-3,
    max_chars=20_000,
    sample_chars=10,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ds_strategy.demo",
        description="Train a small GPT with ZeRO stage 3 on CPU processes, beside ZeRO stage 2 and DDP; print a "
        "comparison table, write a loss/memory PNG, consolidate the checkpoint and sample from it.",
    )
    parser.add_argument("--steps", type=int, default=None, help=f"zero3 optimizer steps (default {FULL.zero3_steps})")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--out", type=Path, default=Path("ds_strategy_demo"), help="output directory")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 2-3 steps per run (a smoke test)")
    # For tests: where to torch.save the zero3 run's trained weights (gathered from every rank).
    parser.add_argument("--trained-weights", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.devices < 1:
        parser.error("--devices must be at least 1")
    return args


def plan_for(args: argparse.Namespace) -> Plan:
    plan = QUICK if args.quick else FULL
    if args.steps is not None:
        plan = replace(plan, zero3_steps=args.steps, brief_steps=min(plan.brief_steps, args.steps))
    return plan


def is_rank_zero() -> bool:
    """Rank 0 is the process the user started; Lightning gives the ones it starts LOCAL_RANK >= 1."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def processes(n: int) -> str:
    return f"{n} CPU process" + ("es" if n != 1 else "")


def say(message: str) -> None:
    if is_rank_zero():
        print(message, flush=True)


def quiet_lightning() -> None:
    """The demo's own lines tell what runs where; Lightning's per-Trainer banners and the advice for
    GPU-sized jobs (dataloader workers, logging interval) would only bury them."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    for pattern in (
        ".*does not have many workers.*",
        ".*smaller than the logging interval.*",
        # deprecations inside Lightning itself, with this torch
        ".*isinstance.treespec, LeafSpec.*",
        ".*torch.distributed.nn.functional.all_gather is deprecated.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


class SaveAtTrainEnd(L.Callback):
    """``trainer.save_checkpoint`` at the end of training, while the ZeRO engine still holds the partitions
    (after ``fit`` it is released, and a save would write one plain file of weights)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class GenerateAtTrainEnd(L.Callback):
    """At the end of the zero3 fit, while the engine holds the partitions: text from ``engine.generate`` under
    the hybrid engine (every partitioned parameter gathered once for the call, not per module per token),
    sampled and greedy. Every rank generates (the gather is collective); rank 0 reports."""

    def __init__(self, chars: int) -> None:
        self.chars = chars
        self.sampled: list[int] = []
        self.greedy: list[int] = []
        self.seconds = 0.0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        generate = pl_module.model.generate  # type: ignore[union-attr]  # the GPT's decoding loop, run by the engine
        prompt = torch.tensor([list(PROMPT.encode())])
        engine.eval()
        torch.manual_seed(0)
        start = time.perf_counter()
        self.sampled = engine.generate(prompt, self.chars, generate_fn=generate)[0].tolist()
        self.seconds = time.perf_counter() - start
        self.greedy = engine.generate(prompt, self.chars, generate_fn=generate, do_sample=False)[0].tolist()
        engine.train()


def zero3_strategy(out: Path) -> Any:
    """``"zero3"`` plus the hybrid engine (for the sample) and the flops profiler (tokens/s and MFU in the
    progress bar; one step's profile written to ``out/flops_profile.txt``)."""
    from ds_strategy.lightning import ZeroStrategy

    return ZeroStrategy(
        stage=3,
        config={
            "hybrid_engine": {"enabled": True, "pin_parameters": False},
            "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(out / FLOPS_PROFILE)},
        },
    )


def fit(
    name: str,
    strategy: Any,
    plan: Plan,
    steps: int,
    dataset: CharDataset,
    devices: int,
    callbacks: list[L.Callback],
) -> tuple[L.Trainer, RunRecorder]:
    L.seed_everything(0, verbose=False)  # the same initial weights and data order for every strategy
    module = GPTModule(plan.model, plan.lr, schedule_steps=plan.zero3_steps)
    loader = DataLoader(dataset, batch_size=plan.batch_size, shuffle=True, drop_last=True)
    recorder = RunRecorder(name)
    per_epoch = len(dataset) // (plan.batch_size * devices)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        max_epochs=-(-steps // max(per_epoch, 1)),  # what the progress bar shows as the last epoch
        callbacks=[recorder, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader)
    return trainer, recorder


def consolidate(checkpoint: Path, output: Path) -> list[str]:
    """The command that turns the sharded checkpoint into one fp32 file: the ``ds-zero-to-fp32`` console
    script installed beside this Python, else the module it runs."""
    script = Path(sys.executable).parent / "ds-zero-to-fp32"
    if script.is_file():
        command = [str(script), str(checkpoint), str(output)]
    elif shutil.which("ds-zero-to-fp32"):
        command = ["ds-zero-to-fp32", str(checkpoint), str(output)]
    else:
        command = [sys.executable, "-m", "ds_strategy.runtime.checkpoint.consolidate", str(checkpoint), str(output)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return command


def strip_prefix(state_dict: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    """GPTModule keeps the network as ``self.model``: its state-dict keys start with ``model.``."""
    return {k.removeprefix(prefix): v for k, v in state_dict.items()}


def weights_match(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """(same keys and bit-identical values, largest absolute difference)."""
    if a.keys() != b.keys():
        return False, float("inf")
    gap = max((float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel()), default=0.0)
    return all(torch.equal(a[k], b[k]) for k in a), gap


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_for(args)
    quiet_lightning()
    out: Path = args.out.resolve()
    started = time.perf_counter()
    dataset = CharDataset(corpus_text(plan.max_chars), plan.model.block_size)
    n_params = sum(p.numel() for p in GPT(plan.model).parameters())
    say(
        f"ds_strategy demo: a {n_params / 1e6:.2f}M-parameter GPT on pydoc's topics ({len(dataset.data):,} bytes), "
        f"{processes(args.devices)}, output in {out}"
    )
    if is_rank_zero():
        # Built (or found in the cache) once, before Lightning starts rank 1, which then loads it from the cache.
        from ds_strategy.ops import load_cpu_kernels

        kernels = "C++ (" + torch.ops.ds_strategy.simd_isa() + ")" if load_cpu_kernels() else "pure-torch fallbacks"
        say(f"kernels: {kernels}")
        # Before Lightning starts rank 1, which inherits the setting (DS_STRATEGY_PEAK_TFLOPS).
        peak = measured_peak_flops()
        set_peak_tflops(peak / 1e12)
        say(f"MFU is against this core's measured fp32 matmul rate: {peak / 1e9:.1f} GFLOP/s per rank")
    checkpoint = out / CHECKPOINT
    if is_rank_zero() and checkpoint.is_dir():
        shutil.rmtree(checkpoint)  # a fresh checkpoint, not one tag replacing another in an old directory
    elif is_rank_zero() and checkpoint.exists():
        checkpoint.unlink()

    sampler = GenerateAtTrainEnd(plan.sample_chars)
    runs: list[tuple[str, Any, int, list[L.Callback]]] = [
        ("zero3", zero3_strategy(out), plan.zero3_steps, [SaveAtTrainEnd(checkpoint), sampler]),
        ("zero2", "zero2", plan.brief_steps, []),
        ("ddp", "ddp", plan.brief_steps, []),
    ]
    results: list[RunResult] = []
    trained: dict[str, Any] = {}
    first: L.Trainer | None = None
    for i, (name, strategy, steps, callbacks) in enumerate(runs, 1):
        shown = repr(strategy) if isinstance(strategy, str) else "ZeroStrategy(stage=3, hybrid engine + flops profiler)"
        say(f"\n[{i}/{len(runs)}] Trainer(strategy={shown}, accelerator='cpu', devices={args.devices}): {steps} steps")
        trainer, recorder = fit(name, strategy, plan, steps, dataset, args.devices, callbacks)
        first = first or trainer
        if name == "zero3":
            trained = strip_prefix(trainer.strategy.lightning_module_state_dict())  # gathered at teardown
        if recorder.result is not None:
            results.append(recorder.result)

    assert first is not None
    rank = first.global_rank
    if torch.distributed.is_initialized():
        # Every rank leaves the process group together: no collective thread is left running at exit.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if rank != 0:
        return 0

    train_s = time.perf_counter() - started
    try:
        report(results, plan, args, out, checkpoint, trained, sampler)
    finally:
        _wait_for_workers(first)
    say(f"\ntotal {time.perf_counter() - started:.0f} s (three fits {train_s:.0f} s)")
    return 0


def report(
    results: list[RunResult],
    plan: Plan,
    args: argparse.Namespace,
    out: Path,
    checkpoint: Path,
    trained: dict[str, Any],
    sampler: GenerateAtTrainEnd,
) -> None:
    from rich.console import Console

    from ds_strategy.demo.report import comparison_table, plot

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # a pipe or a log file: rich would assume 80 columns
    title = f"small GPT on pydoc topics, {processes(args.devices)}, same seed and data order"
    console.print()
    flops_per_token = training_flops_per_token(GPT(plan.model), plan.batch_size, plan.model.block_size, VOCAB_SIZE)
    peak = peak_flops(torch.device("cpu"), torch.float32)
    console.print(comparison_table(results, title=title, flops_per_token=flops_per_token, peak_per_rank=peak))
    console.print(
        f"MFU: tokens/s x {flops_per_token / 1e6:.1f} MFLOP per token (3 x the forward, counted by "
        f"ds_strategy.profiling) / ({processes(args.devices)} x {(peak or float('nan')) / 1e9:.1f} GFLOP/s)",
        highlight=False,
    )
    png = plot(results, out / PLOT, title=title)

    consolidated = out / CONSOLIDATED
    command = consolidate(checkpoint, consolidated)
    state = strip_prefix(torch.load(consolidated, weights_only=True))
    bare = GPT(plan.model)  # plain torch: no strategy, no process group
    bare.load_state_dict(state, strict=True)
    same, gap = weights_match(state, trained)
    verdict = "bit-identical" if same else f"DIFFERENT (largest difference {gap:.2e})"
    console.print(f"\nconsolidated: {Path(command[0]).name} {checkpoint.name} -> {consolidated.name}")
    console.print(f"consolidated weights vs the zero3 run's gathered weights: {len(state)} tensors, {verdict}")
    if args.trained_weights is not None:
        torch.save(trained, args.trained_weights)

    prompt = torch.tensor([list(PROMPT.encode())])
    bare_greedy = bare.eval().generate(prompt, plan.sample_chars, do_sample=False)[0].tolist()
    agree = "equal" if bare_greedy == sampler.greedy else "DIFFERENT"
    console.print(
        f"greedy tokens of the bare GPT vs engine.generate under the hybrid engine: {len(bare_greedy)}, {agree}"
    )
    console.print(
        f"\nsample from engine.generate under the hybrid engine (zero3, {sampler.seconds:.1f} s):", highlight=False
    )
    console.print(decode(sampler.sampled), markup=False, highlight=False)
    console.print(
        f"\ncheckpoint (sharded): {checkpoint}\nconsolidated fp32:    {consolidated}\nplot:                 {png}"
        + (f"\nflops profile:        {out / FLOPS_PROFILE}" if (out / FLOPS_PROFILE).exists() else "")
    )


def _wait_for_workers(trainer: L.Trainer) -> None:
    """Rank 0 returns only after the ranks Lightning started have exited (no orphans)."""
    launcher = getattr(trainer.strategy, "launcher", None)
    for proc in getattr(launcher, "procs", []):
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
