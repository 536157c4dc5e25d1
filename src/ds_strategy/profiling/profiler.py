"""``FlopsProfiler``: DeepSpeed's flops-profiler API over ``torch.utils.flop_counter.FlopCounterMode``.

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(batch)                       # counted: the forward's flops, per module, and its latency
    prof.stop_profile()
    flops = prof.get_total_flops()
    prof.print_model_profile()
    prof.end_profile()

Counting: torch's own flop counter (a dispatch mode) sees every aten op with the shapes it really runs
with: under ZeRO stage 3 the parameters are gathered while their module runs, so the counts are the full
model's. It counts the matrix-multiply family (mm, addmm, bmm, baddbmm, convolutions, scaled dot-product
attention), two flops per multiply-accumulate, so ``MACs = flops / 2`` exactly; elementwise ops, norms and
softmax are not counted (DeepSpeed's own formulas add them as flops without MACs; they are a few percent of
a transformer's total). Each module's count is inclusive: the counter's total at its forward's end minus the
total at its start, summed over calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torch.utils.hooks import RemovableHandle

from .render import render_profile
from .units import duration_to_string, macs_to_string, number_to_string, params_to_string


@dataclass
class ModuleStats:
    """One module's profile: inclusive forward flops and latency, summed over its calls."""

    flops: int = 0
    duration: float = 0.0
    calls: int = 0


def _cpu_sdpa_flop(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


# Ops torch's counter does not know yet: scaled dot-product attention's CPU kernel (the CUDA ones are known).
_EXTRA_FORMULAS: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flop


def _synchronizer(model: nn.Module) -> Callable[[], None]:
    """Accelerator kernels are asynchronous: a latency means something only after the device caught up."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class FlopsProfiler:
    """Measures the flops, MACs, parameters and latency of ``model``'s forward, per module.

    ``ds_engine`` (optional) adds the engine's world size, batch size and backward / step latencies to the
    printed summary; ``recompute_fwd_factor`` is the share of the forward recomputed in backward by
    activation checkpointing (0.0: none, 1.0: all), so a training step costs ``(3 + factor) x`` forward flops.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._handles: list[RemovableHandle] = []
        self._stats: dict[nn.Module, ModuleStats] = {}
        self._open: list[tuple[nn.Module, float, int]] = []  # (module, start time, counted flops at start)
        self._ignored_depth = 0
        self._ignored_start = 0
        self._ignored_flops = 0
        self._numel: dict[int, int] = {}  # id(param) -> largest numel seen (gathered under ZeRO stage 3)
        self._sync: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ DeepSpeed's API
    def start_profile(self, ignore_list: Iterable[type[nn.Module]] | None = None) -> None:
        """Reset the counts and count from now on. Modules whose type is in ``ignore_list`` are not
        counted: neither their flops (nor their submodules') nor their latency enter any total."""
        self.reset_profile()
        self._remove_hooks()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                self._handles.append(module.register_forward_pre_hook(self._ignore_start))
                self._handles.append(module.register_forward_hook(self._ignore_end, always_call=True))
            else:
                self._handles.append(module.register_forward_pre_hook(self._module_start))
                self._handles.append(module.register_forward_hook(self._module_end, always_call=True))
        self._sync = _synchronizer(self.model)
        if self._counter is None:
            self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
            self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until ``end_profile``."""
        self._remove_hooks()
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)

    def reset_profile(self) -> None:
        self._stats = {m: ModuleStats() for m in self.model.modules()}
        self._open.clear()
        self._ignored_depth = self._ignored_start = self._ignored_flops = 0
        for p in self.model.parameters():
            self._numel[id(p)] = max(self._numel.get(id(p), 0), p.numel())
        if self._counter is not None:  # a restart while counting: the counter's total runs on
            self._ignored_flops = self._counter.get_total_flops()

    def end_profile(self) -> None:
        """Stop counting and drop the profile."""
        if not self.started:
            return
        self.stop_profile()
        self._stats.clear()
        self.started = False

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Floating-point operations of the profiled forward(s) (the matmul family, see the module doc)."""
        flops = self.module_flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the profiled forward(s): flops / 2."""
        macs = self.module_flops(self.model) // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds the profiled forward(s) took, measured at the model's own forward."""
        duration = self.module_duration(self.model)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model, at their full size also when ZeRO stage 3 partitions them."""
        params = self.module_params(self.model)
        return params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the summary, the top ``top_modules`` module types per depth (down to ``module_depth``, -1:
        all) and, with ``detailed``, a table of every module; into ``output_file`` when given."""
        if not self.started:
            return
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w") as f:
                render_profile(self, f, profile_step, module_depth, top_modules, detailed)
        else:
            render_profile(self, None, profile_step, module_depth, top_modules, detailed)

    # ------------------------------------------------------------------ per-module reads
    def module_flops(self, module: nn.Module) -> int:
        stats = self._stats.get(module)
        if stats is not None and stats.calls:
            return stats.flops
        return sum(self.module_flops(c) for c in module.children())  # a container never called (ModuleList)

    def module_duration(self, module: nn.Module) -> float:
        stats = self._stats.get(module)
        if stats is not None and stats.calls:
            return stats.duration
        return sum(self.module_duration(c) for c in module.children())

    def module_params(self, module: nn.Module) -> int:
        return sum(max(self._numel.get(id(p), 0), p.numel()) for p in module.parameters())

    # ------------------------------------------------------------------ hooks
    def _counted(self) -> int:
        """Flops counted so far, less those inside ignored modules."""
        if self._counter is None:
            return 0
        return self._counter.get_total_flops() - self._ignored_flops

    def _module_start(self, module: nn.Module, args: Any) -> None:
        # Runs after ZeRO stage 3's own pre-hook (registered earlier): the module's parameters are gathered.
        for p in module.parameters(recurse=False):
            self._numel[id(p)] = max(self._numel.get(id(p), 0), p.numel())
        if self._ignored_depth:
            return
        self._sync()
        self._open.append((module, time.perf_counter(), self._counted()))

    def _module_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._ignored_depth:
            return
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] is module:
                _, started, flops_at_start = self._open.pop(i)
                break
        else:
            return  # started before start_profile
        self._sync()
        stats = self._stats.setdefault(module, ModuleStats())
        stats.duration += time.perf_counter() - started
        stats.flops += self._counted() - flops_at_start
        stats.calls += 1

    def _ignore_start(self, module: nn.Module, args: Any) -> None:
        if self._ignored_depth == 0 and self._counter is not None:
            self._ignored_start = self._counter.get_total_flops()
        self._ignored_depth += 1

    def _ignore_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._ignored_depth == 0:
            return
        self._ignored_depth -= 1
        if self._ignored_depth == 0 and self._counter is not None:
            self._ignored_flops += self._counter.get_total_flops() - self._ignored_start

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
