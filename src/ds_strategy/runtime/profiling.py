"""The engine's side of ``flops_profiler`` and of the throughput figures (tokens/s, MFU).

With ``flops_profiler.enabled``, rank 0 profiles the training forwards run while ``global_steps ==
profile_step`` (the last one counts, as in DeepSpeed) and prints the profile when that step's optimizer step
is done. From then on one sample is known to cost ``(3 + recompute_fwd_factor) x`` the profiled forward's
flops per sample (forward 1, backward 2, recomputation), which turns samples/s into achieved flops/s and,
against the device's peak, into MFU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ds_strategy.config import FlopsProfilerConfig
from ds_strategy.profiling import FlopsProfiler, SpeedMeter, batch_tokens, peak_flops


class EngineProfiling:
    """Owned by the engine: counts tokens, runs the flops profiler at its step, computes the rates."""

    def __init__(
        self,
        engine: Any,
        module: nn.Module,
        config: FlopsProfilerConfig,
        *,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sequence_shards: int = 1,
    ) -> None:
        self.config = config
        # Ulysses: a rank's forward covers 1/P of each sample (its shard of the sequence), so a sample's flops
        # are P times what the profiled forward measured; samples are counted per sequence-parallel group.
        self._shards = sequence_shards
        self.profiler = FlopsProfiler(module, engine, config.recompute_fwd_factor) if config.enabled else None
        self._module = module
        self._rank, self._world_size, self._micro_batch = rank, world_size, micro_batch_size
        self._device, self._dtype = device, dtype
        self.tokens = 0  # this rank's tokens of training forwards so far
        self.flops_per_sample: float | None = None  # a training step's flops per sample, once profiled
        self._per_step, self._per_report = SpeedMeter(), SpeedMeter()
        self.latest: dict[str, float] = {}
        self.last_profile: dict[str, float] = {}  # rank 0: the profiled forward's flops, macs, params, duration

    def _profiling(self, global_steps: int) -> bool:
        return self.profiler is not None and self._rank == 0 and global_steps == self.config.profile_step

    @contextmanager
    def forward(self, global_steps: int, inputs: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Iterator[None]:
        """Wrap one forward: count its tokens (training mode only) and profile it at ``profile_step``."""
        if not self._module.training:
            yield
            return
        self.tokens += batch_tokens(inputs, kwargs) or 0
        profiling = self._profiling(global_steps)
        if profiling:
            assert self.profiler is not None
            self.profiler.start_profile()
        try:
            yield
        finally:
            if profiling:
                assert self.profiler is not None
                self.profiler.stop_profile()

    def step_done(self, finished_step: int, global_samples: int) -> None:
        """After optimizer step number ``finished_step`` (global_steps before it was incremented)."""
        prof = self.profiler
        if self._profiling(finished_step) and prof is not None and prof.started:
            fwd_flops = int(prof.get_total_flops())
            self.last_profile = {
                "flops": fwd_flops,
                "macs": int(prof.get_total_macs()),
                "params": int(prof.get_total_params()),
                "duration": float(prof.get_total_duration()),
            }
            self.flops_per_sample = (
                (3.0 + self.config.recompute_fwd_factor) * fwd_flops * self._shards / self._micro_batch
            )
            prof.print_model_profile(
                profile_step=finished_step,
                module_depth=self.config.module_depth,
                top_modules=self.config.top_modules,
                detailed=self.config.detailed,
                output_file=self.config.output_file,
            )
            prof.end_profile()
        self.latest = self._read(self._per_step, global_samples)

    def report(self, global_samples: int) -> str:
        """The extra fields of the steps_per_print line: tokens/sec, TFLOPS and MFU where known."""
        rates = self._read(self._per_report, global_samples)
        parts = []
        if "tokens_per_sec" in rates:
            parts.append(f"tokens/sec={rates['tokens_per_sec']:.2f}")
        if "tflops" in rates:
            parts.append(f"TFLOPS={rates['tflops']:.3g}")
        if "mfu" in rates:
            parts.append(f"MFU={100 * rates['mfu']:.2f}%")
        return (" " + " ".join(parts)) if parts else ""

    def _read(self, meter: SpeedMeter, global_samples: int) -> dict[str, float]:
        # Every rank is taken to see batches of this rank's shape, as samples/sec takes full batches.
        return meter.read(
            global_samples,
            self.tokens * self._world_size,
            flops_per_sample=self.flops_per_sample,
            peak_per_device=peak_flops(self._device, self._dtype) if self.flops_per_sample is not None else None,
            devices=self._world_size,
        )
