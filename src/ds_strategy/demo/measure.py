"""What the demo measures in every run, on every rank: the loss per step, tokens per second and peak memory.

``RunRecorder`` is a Lightning callback. Each rank records its own numbers; at the end of training the
ranks all-gather them through the strategy (``trainer.strategy.all_gather``, one collective for every
strategy), so rank 0 holds every rank's measured peak memory rather than assuming the others match its own.

Two memory figures per rank:

- model states: the bytes of parameters, gradients, fp32 masters and optimizer state this rank holds at the
  end of training, as the ZeRO engine counts them (``engine.memory_breakdown()``) or, for other strategies,
  summed over the module's parameters, their ``.grad`` and the optimizer's state tensors (DDP's gradient
  buckets are not included). This is what ZeRO partitions.
- peak RSS: the process's resident set (``ds_strategy.get_accelerator("cpu").memory_stats()``: VmRSS and
VmHWM on Linux). The high-water mark is reset when the run is set up (before the strategy builds its engine
or wraps the model), so several runs in one process each get their own peak, not the maximum so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import lightning as L
from ds_strategy.accelerator import get_accelerator

MIB = 1024 * 1024


def rank_memory() -> tuple[int, int]:
    """(resident set size, its peak since the last reset) of this process, in bytes."""
    stats = get_accelerator("cpu").memory_stats()
    return stats.allocated, stats.peak if stats.peak is not None else stats.allocated


def tensor_state_bytes(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Bytes of ``module``'s parameters (a tied one once), their gradients and the optimizers' state tensors."""
    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total


def model_state_bytes(trainer: L.Trainer) -> int:
    """This rank's model states: the ZeRO engine's own count when the strategy has one, else the tensors'."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None and hasattr(engine, "memory_breakdown"):
        return int(sum(engine.memory_breakdown().values()))
    return tensor_state_bytes(trainer.lightning_module, trainer.optimizers)


def training_flops_per_token(model: torch.nn.Module, batch: int, seq: int, vocab: int) -> float:
    """A training step's flops per token: 3 x the forward's (backward ~2x forward, DeepSpeed's convention),
    the forward counted by ``ds_strategy.profiling.get_model_profile`` on a (batch, seq) batch of tokens."""
    from ds_strategy.profiling import get_model_profile

    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    flops, _, _ = get_model_profile(model, args=[tokens], print_profile=False, warm_up=0, as_string=False)
    return 3.0 * float(flops) / tokens.numel()


def measured_peak_flops(seconds: float = 0.5, n: int = 1024) -> float:
    """fp32 matmul flops per second of one core (one thread), timed here: a CPU has no datasheet peak in
    ``ds_strategy.profiling``'s table, so the demo's MFU is against what this core reaches on a large matmul."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            a @ b
            calls += 1
        return 2.0 * n**3 * calls / elapsed
    finally:
        torch.set_num_threads(threads)


def reset_peak_memory() -> bool:
    """Restart this process's peak-memory mark from its current RSS; False where the platform cannot."""
    return get_accelerator("cpu").reset_peak_memory_stats()


@dataclass
class RunResult:
    """One training run as rank 0 reports it (every list indexed by step or by rank)."""

    name: str
    losses: list[float]  # per step, mean over ranks
    tokens_per_s: float  # all ranks together, after the warm-up step
    peak_rss: list[int]  # bytes, per rank, measured on that rank
    state_bytes: list[int]  # bytes of parameters, gradients, masters and optimizer state, per rank
    setup_rss: list[int]  # bytes, per rank, when the run was set up
    peak_is_per_run: bool = True  # False where the peak could not be reset (then it is the process's peak)

    @property
    def steps(self) -> int:
        return len(self.losses)


def summarize(name: str, losses: torch.Tensor, stats: torch.Tensor, peak_is_per_run: bool = True) -> RunResult:
    """Rank 0's summary of the gathered per-rank records.

    ``losses``: (world, steps) local loss per rank and step. ``stats``: (world, 5) per rank
    [timed tokens, timed seconds, peak RSS, RSS at setup, model-state bytes].
    """
    if losses.dim() != 2 or stats.dim() != 2 or stats.size(1) != 5 or losses.size(0) != stats.size(0):
        raise ValueError(
            f"expected (world, steps) losses and (world, 5) stats, got {list(losses.shape)}, {list(stats.shape)}"
        )
    tokens, seconds = stats[:, 0].sum().item(), stats[:, 1].max().item()
    return RunResult(
        name=name,
        losses=losses.double().mean(0).tolist(),
        tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
        peak_rss=[int(v) for v in stats[:, 2].tolist()],
        setup_rss=[int(v) for v in stats[:, 3].tolist()],
        state_bytes=[int(v) for v in stats[:, 4].tolist()],
        peak_is_per_run=peak_is_per_run,
    )


class RunRecorder(L.Callback):
    """Records one ``fit``; after it, rank 0's ``result`` holds every rank's numbers (None on other ranks).

    ``gather`` defaults to ``trainer.strategy.all_gather``; tests pass another collective.
    """

    def __init__(self, name: str, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.name = name
        self.gather = gather
        self.result: RunResult | None = None
        self._losses: list[torch.Tensor] = []
        self._tokens = 0
        self._timed_from: float | None = None
        self._setup_rss = 0
        self._reset = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Called after the process group exists and before the strategy builds its engine.
        self._setup_rss = rank_memory()[0]
        self._reset = reset_peak_memory()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The first step pays one-time costs (buffers, kernel warm-up): timed from the second when there is one.
        warmup = 1 if trainer.max_steps > 2 else 0
        if trainer.global_step == warmup and self._timed_from is None:
            self._timed_from = time.perf_counter()
            self._tokens = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._losses.append(loss.detach().reshape(()))  # kept on the device: read once, at the end
        self._tokens += int(batch[0].numel())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        elapsed = time.perf_counter() - self._timed_from if self._timed_from is not None else 0.0
        _, peak = rank_memory()
        # The records travel on the losses' device (the model's): NCCL takes no host tensor.
        device = self._losses[0].device if self._losses else torch.device("cpu")
        local_losses = torch.stack(self._losses).double() if self._losses else torch.zeros(0, dtype=torch.float64)
        local_losses = local_losses.to(device)
        state = model_state_bytes(trainer)
        stats_row = [self._tokens, elapsed, peak, self._setup_rss, state]
        local_stats = torch.tensor(stats_row, dtype=torch.float64, device=device)
        gather = self.gather or trainer.strategy.all_gather
        losses = _stacked(gather(local_losses), local_losses).cpu()
        stats = _stacked(gather(local_stats), local_stats).cpu()
        local_reset = torch.tensor([float(self._reset)], device=device)
        resets = _stacked(gather(local_reset), local_reset).cpu()
        if trainer.is_global_zero:
            self.result = summarize(self.name, losses, stats, peak_is_per_run=bool(resets.min().item() > 0))


def _stacked(gathered: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """(world, ...): Lightning's all_gather returns the tensor itself when no process group exists."""
    return gathered.unsqueeze(0) if gathered.dim() == local.dim() else gathered


def mib(values: Sequence[int]) -> list[float]:
    return [v / MIB for v in values]
