"""``ds_strategy.autotune``: the fastest configuration that fits, found in the processes that train.

    result = ds_strategy.autotune(make_model, dataset, "ds_config.json")   # every rank calls it
    engine, *_ = ds_strategy.initialize(model=result.apply(make_model()), config=result.best_config)

The steps, each in its own module: profile the model once (profile.py), list the candidates with the global
batch held (space.py), predict each one's peak memory (runtime/memory.py) and drop those over the cap, try
the rest in the tuner's order (tuners.py), each trial in-process with a fresh engine (trial.py), until the
trial budget, the time budget or early stopping ends the search; rank, report and write (report.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_strategy.accelerator import get_accelerator
from ds_strategy.comm import init_distributed
from ds_strategy.config import DeepSpeedConfig, load_config
from ds_strategy.log import get_logger
from ds_strategy.profiling.peak import peak_flops
from ds_strategy.runtime.memory import estimate_memory

from . import report
from .data import LossFn, batch_fn_of, default_loss
from .profile import ModelProfile, checkpoint_blocks, profile_model
from .refine import CALIBRATED, Calibration, combine
from .space import Candidate, SearchSpace, candidates, global_batch, micro_batch_choices
from .trial import OK, PRUNED, TrialResult, TrialSetup, all_ranks_max, run_trial, warm_up
from .tuners import EarlyStop, make_tuner

log = get_logger(__name__)

_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class AutotuneResult:
    """A finished tune: every trial ranked (fitted ones by the metric, best first; then the rest), the winner
    and its config (a ds_config dict: ``initialize(config=...)`` / ``ZeroStrategy(config=...)`` take it)."""

    trials: list[TrialResult]
    best: TrialResult | None
    best_config: dict[str, Any] | None
    profile: ModelProfile
    metric: str
    wall_s: float
    results_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)

    def apply(self, model: nn.Module) -> nn.Module:
        """Make the winner's model change (activation checkpointing of every block, when it won); returns
        ``model``."""
        if self.best is not None and self.best.candidate.activation_checkpointing:
            checkpoint_blocks(model)
        return model

    def print_table(self) -> None:
        report.print_trials(self.trials, _title(self))


def autotune(
    model_fn: Callable[[], nn.Module],
    data: Any,
    config: Mapping[str, Any] | str | os.PathLike[str] | DeepSpeedConfig,
    *,
    loss_fn: LossFn | None = None,
    optimizer: Any = None,
    space: SearchSpace | None = None,
    time_budget_s: float | None = None,
    device: torch.device | str | None = None,
    trial_timeout_s: float = 300.0,
    verbose: bool = True,
) -> AutotuneResult:
    """Find the fastest configuration of ``model_fn()``'s training that fits (see the module docstring).

    ``model_fn``: builds a fresh model (called once to profile and once per trial). ``data``: a callable
    ``(micro_batch_size, step) -> batch``, a map-style dataset or a tensor of samples (autotuning/data.py).
    ``config``: the base ds_config (dict, JSON path or ``DeepSpeedConfig``); its ``autotuning`` block sets the
    metric, profile steps, tuner, trial budget, micro-batch bounds, memory cap and result folders, and its
    batch keys the global batch every candidate holds. ``loss_fn(model, batch)``: the loss (default: what the
    forward returns, or its ``.loss``). ``optimizer``: as ``initialize`` takes it (None: the config's
    ``optimizer`` block). ``space``: what may vary (default ``SearchSpace()``). ``time_budget_s``: stop
    starting trials after this long (default: the block's ``time_budget_s``, else none). ``trial_timeout_s``:
    how long a collective inside a trial may wait for a rank that failed (trial.py, [Note: failing together]).
    Every rank calls it with the same arguments; it returns the same result on every rank.
    """
    started = time.perf_counter()
    raw = _raw_config(config)
    init_distributed()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    checked = load_config(raw, world_size=world)
    # A sequence-parallel group of sp ranks trains one data-parallel replica on the same samples: the global
    # batch splits over the data-parallel ranks (world / sp), and the ranks of one group read the same rows.
    sp = int(checked.sequence_parallel_size)
    dp = world // sp
    tuning = checked.autotuning
    space = space or SearchSpace()
    device = torch.device(device) if device is not None else _default_device()
    budget = time_budget_s if time_budget_s is not None else tuning.time_budget_s

    total = int(checked.train_batch_size) if checked.train_batch_size else global_batch(raw, dp)
    if tuning.max_train_batch_size is not None and total > tuning.max_train_batch_size:
        raise ValueError(
            f"autotuning.max_train_batch_size is {tuning.max_train_batch_size} but the config's global batch is "
            f"{total}: lower train_batch_size or raise max_train_batch_size"
        )
    if total % dp:
        where = f"{dp} data-parallel ranks ({world} ranks / sequence_parallel_size {sp})" if sp > 1 else f"{dp} ranks"
        raise ValueError(f"the global batch {total} does not split over {where}: make it a multiple of {dp}")
    per_rank = total // dp
    micros = micro_batch_choices(
        per_rank,
        int(tuning.min_train_micro_batch_size_per_gpu),
        int(tuning.max_train_micro_batch_size_per_gpu),
        space.micro_batches,
    )
    if not micros:
        raise ValueError(
            f"no micro-batch size divides the per-rank batch {per_rank} within autotuning."
            f"min_train_micro_batch_size_per_gpu={tuning.min_train_micro_batch_size_per_gpu} .. "
            f"max_train_micro_batch_size_per_gpu={tuning.max_train_micro_batch_size_per_gpu}"
        )

    batch_fn = batch_fn_of(data, rank // sp, dp)  # sequence groups are consecutive ranks (sequence/groups.py)
    loss = loss_fn or default_loss
    precision = _precision(checked)
    profile = profile_model(model_fn, batch_fn, loss, device, dtype=_dtype(precision), two_samples=per_rank >= 2)
    if sp > 1:  # measured on whole sequences; each rank of a sequence group holds 1/sp of every activation
        profile = replace(
            profile,
            activation_bytes_per_sample=profile.activation_bytes_per_sample // sp,
            checkpointed_activation_bytes_per_sample=profile.checkpointed_activation_bytes_per_sample // sp,
        )
    # Every rank must prune and pick alike: the largest activation bytes, the smallest cap (free memory differs).
    profile, cap = _agreed(profile, tuning.memory_cap(device), device)
    states = _optimizer_name(raw, optimizer)
    everything = [
        c
        for c in candidates(space, micros, per_rank, fast=tuning.fast)
        if profile.blocks or not c.activation_checkpointing
    ]
    predicted = {c: predict_peak(profile, c, world, precision, states, device, raw) for c in everything}
    runnable = _keep_largest(
        [c for c in everything if cap is None or predicted[c] <= cap], int(tuning.num_tuning_micro_batch_sizes)
    )
    pruned = [
        TrialResult(c, PRUNED, predicted_bytes=predicted[c])
        for c in everything
        if cap is not None and predicted[c] > cap
    ]

    setup = TrialSetup(
        model_fn=model_fn,
        batch_fn=batch_fn,
        loss_fn=loss,
        optimizer=optimizer,
        base_config=raw,
        device=device,
        world_size=world,
        sequence_parallel=sp,
        start_step=int(tuning.start_profile_step),
        end_step=int(tuning.end_profile_step),
        cap_bytes=cap,
        train_flops_per_sample=profile.train_flops_per_sample,
        peak_flops_per_device=peak_flops(device, _dtype(precision)),
        trial_timeout_s=trial_timeout_s,
    )
    results_dir, exps_dir = Path(tuning.results_dir), Path(tuning.exps_dir)
    reused = {} if tuning.overwrite else {t["name"]: t for t in report.read_trials(results_dir)}
    if runnable:
        warm_up(raw, device)
    tuner = make_tuner(tuning.tuner_type, runnable)
    stop = EarlyStop(int(tuning.tuner_early_stopping))
    calibration = Calibration(cap)  # [Note: the calibrated memory model] in refine.py
    ran: list[TrialResult] = []
    show = verbose and rank == 0

    def spent() -> bool:  # the slowest rank's clock decides, so every rank stops at the same trial
        return budget is not None and all_ranks_max([time.perf_counter() - started], device)[0] > budget

    with report.progress(min(len(runnable), int(tuning.tuner_num_trials)), show) as advance:
        while len(ran) < int(tuning.tuner_num_trials):
            if spent():
                log.info("autotune: the time budget (%.0f s) is spent after %d trials", budget, len(ran))
                break
            candidate = tuner.next()
            if candidate is None:
                break
            if calibration.rules_out(candidate, predicted[candidate]):
                pruned.append(TrialResult(candidate, CALIBRATED, predicted_bytes=predicted[candidate]))
                tuner.record(candidate, None)
                advance(f"{candidate.name}: skipped, {CALIBRATED}")
                continue
            trial = (
                _from_file(candidate, reused[candidate.name])
                if candidate.name in reused
                else run_trial(setup, candidate)
            )
            trial.predicted_bytes = predicted[candidate]
            calibration.learn(trial)
            ran.append(trial)
            score = _score(trial, tuning.metric)
            tuner.record(candidate, score)
            advance(f"{candidate.name}: {trial.status if not trial.fits else f'{trial.samples_per_s:.2f} samples/s'}")
            if stop.update(score):
                break
        ran = _confirmed(ran, int(tuning.confirm_top), setup, tuning.metric, spent)

    ranked = sorted((t for t in ran if t.fits), key=lambda t: -(_score(t, tuning.metric) or 0.0))
    ranked += [t for t in ran if not t.fits] + pruned
    best = ranked[0] if ranked and ranked[0].fits else None
    configs = {t.candidate.name: t.candidate.to_config(raw, dp) for t in ran}
    result = AutotuneResult(
        trials=ranked,
        best=best,
        best_config=configs[best.candidate.name] if best is not None else None,
        profile=profile,
        metric=tuning.metric,
        wall_s=time.perf_counter() - started,
        results_dir=results_dir,
    )
    result.summary = {
        "metric": tuning.metric,
        "tuner_type": tuning.tuner_type,
        "world_size": world,
        "global_batch": total,
        "device": str(device),
        "memory_cap_bytes": cap,
        "candidates": len(everything),
        "pruned": len(pruned),
        "pruned_calibrated": sum(t.status == CALIBRATED for t in pruned),
        "confirmed": sum(t.runs > 1 for t in ran),
        "trials_run": len(ran),
        "wall_s": round(result.wall_s, 3),
        "profile": vars(profile),
        "best": best.candidate.name if best is not None else None,
    }
    if rank == 0:
        report.write_results(results_dir, exps_dir, ranked, configs, best, result.summary)
        if verbose:
            result.print_table()
    if dist.is_initialized() and world > 1:
        dist.barrier()
    if best is None:
        log.warning("autotune: no configuration fitted; see %s", results_dir / "trials.json")
    return result


def predict_peak(
    profile: ModelProfile,
    c: Candidate,
    world: int,
    precision: str,
    optimizer: str,
    device: torch.device,
    base: Mapping[str, Any],
) -> int:
    """The memory model's per-rank peak for ``c`` (runtime/memory.py), frozen parameters included: what a
    device would hold (on the CPU, where offloaded state is host memory too, the whole peak)."""
    zero = dict(base.get("zero_optimization") or {})
    bucket = c.reduce_bucket_size or int(zero.get("reduce_bucket_size", 500_000_000))
    estimate = estimate_memory(
        profile.params,
        world_size=world,
        stage=c.stage,
        offload=c.offload_optimizer != "none",
        # a partial offload in the base config (offload_optimizer.ratio) keeps 1 - ratio on the device
        offload_ratio=float((zero.get("offload_optimizer") or {}).get("ratio", 1.0))
        if c.offload_optimizer != "none"
        else 1.0,
        precision=precision,
        optimizer=optimizer,
        device=device.type,
        offload_param=c.offload_param != "none",
        activation_bytes_per_sample=(
            profile.checkpointed_activation_bytes_per_sample
            if c.activation_checkpointing
            else profile.activation_bytes_per_sample
        ),
        micro_batch_size=c.micro_batch,
        largest_unit_numel=profile.largest_unit if c.stage == 3 else 0,
        max_live_numel=c.stage3_max_live_parameters,
        # Stage 2 stages gradients in reduce_bucket_size buckets; stage 3 reduces one fetch unit at a time.
        bucket_numel={2: min(bucket, profile.params), 3: min(bucket, profile.largest_unit)}.get(c.stage, 0),
    )
    frozen = (profile.total_params - profile.params) * _SIZES[precision]
    if c.stage == 3:
        frozen //= world
    peak = estimate.peak if device.type == "cpu" else estimate.peak_on_device
    return int(peak + frozen)


def _confirmed(
    ran: list[TrialResult], top: int, setup: TrialSetup, metric: str, spent: Callable[[], bool]
) -> list[TrialResult]:
    """``ran`` with its ``top`` best fitted trials run once more and combined (see [Note: confirming the best]
    in refine.py); nothing to confirm when fewer than two fitted."""
    fitted = sorted((t for t in ran if t.fits), key=lambda t: -(_score(t, metric) or 0.0))
    if len(fitted) < 2:
        return ran
    again: dict[int, TrialResult] = {}
    for first in fitted[:top]:
        if spent():
            break
        again[id(first)] = combine(first, run_trial(setup, first.candidate))
    return [again.get(id(t), t) for t in ran]


def _keep_largest(runnable: list[Candidate], per_group: int) -> list[Candidate]:
    """Of each group (candidates differing only in micro batch), the ``per_group`` largest micro batches
    (``num_tuning_micro_batch_sizes``): larger micro batches run faster while they fit."""
    if per_group <= 0:
        return runnable
    by_group: dict[tuple[object, ...], set[int]] = {}
    for c in runnable:
        by_group.setdefault(c.group, set()).add(c.micro_batch)
    keep = {key: set(sorted(ms)[-per_group:]) for key, ms in by_group.items()}
    return [c for c in runnable if c.micro_batch in keep[c.group]]


def _score(result: TrialResult, metric: str) -> float | None:
    """Higher is better; None for a trial that did not fit."""
    if not result.fits or result.step_s is None:
        return None
    if metric == "latency":
        return -result.step_s
    if metric == "flops":
        return result.flops_per_s
    return result.samples_per_s


def _from_file(candidate: Candidate, saved: Mapping[str, Any]) -> TrialResult:
    """A trial of an earlier tune with ``overwrite: false`` (DeepSpeed skips experiments it has results of)."""
    keys = ("step_s", "samples_per_s", "peak_bytes", "flops_per_s", "mfu", "wall_s")
    return TrialResult(candidate, str(saved.get("status", OK)), **{k: saved.get(k) for k in keys})  # type: ignore[arg-type]


def _agreed(profile: ModelProfile, cap: int | None, device: torch.device) -> tuple[ModelProfile, int | None]:
    """The profile with each rank's largest measurements and the smallest cap of all ranks."""
    a, c, f, neg_cap = all_ranks_max(
        [
            float(profile.activation_bytes_per_sample),
            float(profile.checkpointed_activation_bytes_per_sample),
            profile.forward_flops_per_sample,
            -float(cap) if cap is not None else -math.inf,
        ],
        device,
    )
    agreed = replace(
        profile,
        activation_bytes_per_sample=int(a),
        checkpointed_activation_bytes_per_sample=int(c),
        forward_flops_per_sample=f,
    )
    return agreed, None if math.isinf(neg_cap) else int(-neg_cap)


def sequence_parallel_of(config: Mapping[str, Any] | str | os.PathLike[str] | DeepSpeedConfig) -> int:
    """The config's ``sequence_parallel_size`` (1 when absent): how many consecutive ranks share samples."""
    value = _raw_config(config).get("sequence_parallel_size", 1)
    return int(value) if isinstance(value, int) and value > 0 else 1


def _raw_config(config: Mapping[str, Any] | str | os.PathLike[str] | DeepSpeedConfig) -> dict[str, Any]:
    if isinstance(config, DeepSpeedConfig):
        from ds_strategy.config.frozen import thaw

        return dict(thaw(config.input_config)) if config.input_config is not None else config.to_dict()
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # a deep, JSON-clean copy
    return dict(json.loads(Path(config).read_text()))


def _default_device() -> torch.device:
    accelerator = get_accelerator()
    if accelerator.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(accelerator.device_type)


def _precision(config: DeepSpeedConfig) -> str:
    if config.bf16.enabled:
        return "bf16"
    if config.fp16.enabled:
        return "fp16"
    return "fp32"


def _dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _optimizer_name(raw: Mapping[str, Any], optimizer: Any) -> str:
    """The optimizer kind the memory model counts states for (a client optimizer: Adam's two, the usual)."""
    block = raw.get("optimizer") or {}
    kind = str(block.get("type", "adam")).lower() if optimizer is None else type(optimizer).__name__.lower()
    return kind if kind in ("adam", "adamw", "adagrad", "lion", "sgd") else "adam"


def _title(result: AutotuneResult) -> str:
    best = result.best.candidate.name if result.best is not None else "none fitted"
    return f"autotune ({result.metric}): {len(result.trials)} configurations, best {best}, {result.wall_s:.1f} s"
