"""The hybrid engine: ``engine.generate(...)`` between training steps (DeepSpeed's ``hybrid_engine`` block).

    engine.eval()
    out = engine.generate(prompt, max_new_tokens=64)        # the module's generate (Hugging Face, our GPT)
    out = engine.generate(prompt, generate_fn=my_sampler)   # or any function: my_sampler(prompt)
    engine.train()

[Note: the hybrid engine's gather]
Without ``hybrid_engine.enabled`` (and at stages 0-2) ``generate`` simply calls the function: at stage 3
every forward of every decoding step gathers each module's buckets through the module hooks and frees
them again, so a 64-token generation all-gathers the model 64+ times. With it, stage 3 gathers every
partitioned bucket once before the call (``tp_gather_partition_size`` bucket all-gathers in flight at a
time) and holds them (see [Note: held buckets] in zero/param_gather.py): the hooks stand aside for the
call, so the ranks need not run the same number of forwards (no ``synced_gpus``). After the call the
buckets are freed, unless ``pin_parameters``: then they stay gathered - later generates and training
forwards read them at no gather cost - until the next optimizer step, which releases them before it
updates the partitions (so the held copy is never stale), as do checkpoint loads and ``destroy``.

Memory rule: the held copy is every partitioned parameter in the compute dtype (``partitioned_numel``
elements; ``engine.memory_breakdown()["gathered_params"]`` shows it while held). It must fit
``zero_optimization.stage3_max_live_parameters``, the limit on gathered elements stage 3 already obeys;
a larger model generates through the per-module hooks instead, with one warning saying so.
``max_out_tokens``: the most tokens (prompt + new) one call may produce, checked before the call from
``max_new_tokens`` (or Hugging Face's ``max_length``) with an error naming the key.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_strategy.accelerator import get_accelerator
from ds_strategy.config.model import HybridEngineConfig

from .inference_tp import TensorParallelGeneration
from .zero.base import ZeroStage

log = logging.getLogger("ds_strategy.runtime")

GenerateFn = Callable[..., Any]


class HybridEngine:
    """``engine.generate`` and the eval/train bookkeeping of a ``ZeroEngine`` (see the module docstring)."""

    def __init__(
        self,
        stage: ZeroStage,
        config: HybridEngineConfig,
        *,
        max_live_numel: int,
        rank: int,
        report: bool = False,
        tensor_parallel: TensorParallelGeneration | None = None,
    ) -> None:
        self.stage = stage
        # inference_tp_size > 1 with enabled (the engine builds it only then): generate tensor-parallel
        # (runtime/inference_tp.py); None otherwise.
        self.tensor_parallel = tensor_parallel
        self.config = config
        self.max_live_numel = max_live_numel
        self.rank = rank
        self.report = report  # wall_clock_breakdown: log each cycle's times on rank 0
        self.last_cycle: dict[str, float] = {}  # the last train/generate cycle's seconds (see mode_changed)
        self._warned_fallback = False
        self._warned_tp_fallback = False
        # Seconds spent since the last eval(): gathering, generating, training (DeepSpeed's latency report).
        self.gather_s = 0.0
        self.generate_s = 0.0
        self.training_s = 0.0
        self._cycle_start: float | None = None
        self._training_start: float | None = None

    @property
    def holds_all(self) -> bool:
        """generate gathers everything once (enabled, and stage 3 has partitions within the memory rule)."""
        numel = self.stage.placement.partitioned_numel()
        if not self.config.enabled or numel == 0:
            return False
        if numel <= self.max_live_numel:
            return True
        if not self._warned_fallback and self.rank == 0:
            log.warning(
                "hybrid_engine: gathering the whole model for generate needs %d elements, above "
                "zero_optimization.stage3_max_live_parameters (%d); generating through the per-module "
                "stage-3 gathers instead (raise stage3_max_live_parameters to allow the one-time gather)",
                numel,
                self.max_live_numel,
            )
        self._warned_fallback = True
        return False

    def generate(self, module: nn.Module, generate_fn: GenerateFn | None, args: Any, kwargs: dict[str, Any]) -> Any:
        fn = generate_fn if generate_fn is not None else getattr(module, "generate", None)
        if fn is None or not callable(fn):
            raise TypeError(
                f"engine.generate(): the module ({type(module).__name__}) has no generate method; pass the "
                "function to run as engine.generate(..., generate_fn=fn)"
            )
        if self.config.enabled:
            self._check_max_out_tokens(fn, args, kwargs)
        start = time.perf_counter()
        if not self.holds_all:
            with self.stage.placement.forward_context():
                out = self._run(fn, args, kwargs, whole=self.stage.placement.partitioned_numel() == 0)
            self.generate_s += time.perf_counter() - start
            return out
        if not self.stage.placement.holding:
            self.stage.placement.hold_gathered(self.config.tp_gather_partition_size)
        gathered = time.perf_counter()
        self.gather_s += gathered - start
        try:
            out = self._run(fn, args, kwargs, whole=True)
        finally:
            if not self.config.pin_parameters:
                self.stage.placement.release_held()
            if self.config.release_inference_cache:
                self.stage.placement.release_caches()
                get_accelerator().empty_cache()
        self.generate_s += time.perf_counter() - gathered
        return out

    def _run(self, fn: GenerateFn, args: Any, kwargs: dict[str, Any], *, whole: bool) -> Any:
        """``fn`` itself, or tensor-parallel when asked and every parameter is whole for the call (stages
        0-2, or stage 3's one-time gather): per-module stage-3 gathers would overwrite the slices."""
        if self.tensor_parallel is None:
            return fn(*args, **kwargs)
        if whole:
            return self.tensor_parallel.generate(fn, args, kwargs)
        if not self._warned_tp_fallback and self.rank == 0:
            log.warning(
                "hybrid_engine.inference_tp_size: generating data-parallel instead, because stage 3 gathers "
                "module by module here (the model is above stage3_max_live_parameters); raise it to allow the "
                "one-time gather that tensor-parallel generation slices"
            )
        self._warned_tp_fallback = True
        return fn(*args, **kwargs)

    def release(self) -> None:
        """Free a pinned hold (before the partitions change: optimizer step, checkpoint load, destroy)."""
        if self.stage.placement.holding:
            self.stage.placement.release_held()

    def close(self) -> None:
        """Close the tensor-parallel group's communicator (engine.destroy)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def _check_max_out_tokens(self, fn: GenerateFn, args: Any, kwargs: dict[str, Any]) -> None:
        total = requested_length(fn, args, kwargs)
        if total is not None and total > self.config.max_out_tokens:
            raise ValueError(
                f"engine.generate(): {total} tokens requested (prompt + new) but hybrid_engine.max_out_tokens "
                f"is {self.config.max_out_tokens}; raise hybrid_engine.max_out_tokens or generate fewer tokens"
            )

    # ------------------------------------------------------------------ eval / train (DeepSpeed's report)
    def mode_changed(self, training: bool) -> None:
        """train(): the training time starts; eval(): a cycle ends (DeepSpeed's hybrid engine prints its
        end-to-end / gather / generate / training times at every eval; here ``last_cycle`` keeps them, and
        ``wall_clock_breakdown`` logs them on rank 0)."""
        now = time.perf_counter()
        if training:
            self._training_start = now
            return
        if self._training_start is not None:
            self.training_s += now - self._training_start
            self._training_start = None
        if self._cycle_start is not None:
            latency = max(now - self._cycle_start, 1e-9)
            self.last_cycle = {
                "latency": latency,
                "gather": self.gather_s,
                "generate": self.generate_s,
                "training": self.training_s,
            }
            if self.report and self.rank == 0:
                log.info(
                    "hybrid engine: E2E latency=%.2fs | gather %.2fs (%.1f%%) | generate %.2fs (%.1f%%) | "
                    "training %.2fs (%.1f%%)",
                    latency,
                    self.gather_s,
                    100 * self.gather_s / latency,
                    self.generate_s,
                    100 * self.generate_s / latency,
                    self.training_s,
                    100 * self.training_s / latency,
                )
        self._cycle_start = now
        self.gather_s = self.generate_s = self.training_s = 0.0


def requested_length(fn: GenerateFn, args: Any, kwargs: dict[str, Any]) -> int | None:
    """Prompt + new tokens a generate call asks for: ``max_new_tokens`` (by keyword, or bound to ``fn``'s
    signature) plus the prompt's last dimension, or Hugging Face's ``max_length``; None when not stated."""
    values = dict(kwargs)
    with contextlib.suppress(TypeError, ValueError):  # no signature, or one these arguments do not fit
        values.update(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
    prompt = kwargs.get("input_ids")
    if not isinstance(prompt, torch.Tensor):
        prompt = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    new = values.get("max_new_tokens")
    if isinstance(new, int):
        return new + (prompt.shape[-1] if prompt is not None else 0)
    length = values.get("max_length")
    return length if isinstance(length, int) else None
