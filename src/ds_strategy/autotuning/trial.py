"""One trial of a tune, run in the processes that called ``autotune``: build, measure, tear down, agree.

A trial builds a fresh model (the user's factory) and engine for its candidate's config, runs
``end_profile_step`` optimizer steps (each ``accumulation`` micro steps) and times the steps from
``start_profile_step`` on (median). Then the engine is destroyed and its memory returned (garbage collected,
the host heap trimmed, the CUDA cache emptied), so trial k's peak never includes trial k-1's buffers.

[Note: a trial's memory]
The peak is what training holds above the trial's start: on CUDA ``max_memory_allocated`` minus what was
allocated before the model was built; on the CPU the resident set's high-water mark minus the resident set
then. The high-water mark is reset once the engine is built: the model as the user's factory builds it
(whole, on the host) is a host-side cost of the build, which a GPU run does not hold on its device (the
engine moves it there partitioned), so only the steps' peak counts, the model states included. Before the
first trial a small engine is built, stepped and destroyed (``warm_up``), so the package's lazy imports,
kernel loads and first-use buffers are not charged to the first trial.
On the CPU an allocation that is never written costs nothing in the resident set, where a GPU would hold
it: during a trial glibc fills every allocation (``mallopt(M_PERTURB)``, what ``MALLOC_PERTURB_`` sets), so
the resident set counts what a device would.

[Note: failing together]
Every rank must reach the same verdict, or the next trial's collectives pair up wrongly. After every
optimizer step the ranks all-reduce (max) a flag "over the memory cap"; a trial that raised
(``torch.OutOfMemoryError``, or any error, on any rank) still ends in the same final all-reduce of
(failed, peak, step time), so all ranks record "does not fit" together and go on with the next trial.
An error raised on one rank only, while its peers wait inside one of the step's collectives, must not hang
them: each trial's engine runs on a process group of its own, created with a short timeout
(``trial_timeout_s``, default 300 s), and its shared-memory collectives get the same bound, so the waiting
ranks raise after it, fail the trial too and meet the failed rank in the final all-reduce (on the default
group). The trial's group is destroyed with its engine.
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_strategy.accelerator import get_accelerator
from ds_strategy.log import get_logger
from ds_strategy.runtime.host_memory import committed_allocations, trim_heap
from ds_strategy.sequence.batch import shard_if_sequences

from .data import BatchFn, LossFn, to_device
from .profile import checkpoint_blocks
from .space import Candidate

log = get_logger(__name__)

OUT_OF_MEMORY = "out of memory"
OVER_CAP = "over the memory cap"
PRUNED = "predicted over the memory cap"
OK = "ok"


@dataclass
class TrialResult:
    """What one trial measured, the same on every rank (see [Note: failing together])."""

    candidate: Candidate
    status: str  # OK, OUT_OF_MEMORY, OVER_CAP, PRUNED or "error: ..."
    step_s: float | None = None  # median optimizer-step time over the profiled steps
    samples_per_s: float | None = None  # global samples per second
    peak_bytes: int | None = None  # the largest rank's peak (see [Note: a trial's memory])
    predicted_bytes: int | None = None  # the memory model's peak for this candidate
    flops_per_s: float | None = None  # model flops per second, all ranks together
    mfu: float | None = None  # flops_per_s over the devices' peak (None: the peak is unknown)
    wall_s: float = 0.0  # the trial's whole time, build and teardown included
    step_times: list[float] = field(default_factory=list)  # this rank's own, every step
    runs: int = 1  # 2 for a confirmed trial (autotuning/refine.py)

    @property
    def fits(self) -> bool:
        return self.status == OK

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "candidate"}
        return {"name": self.candidate.name, **self.candidate.knobs(), **out, "fits": self.fits}


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one tune shares."""

    model_fn: Callable[[], nn.Module]
    batch_fn: BatchFn
    loss_fn: LossFn
    optimizer: Any  # what ``initialize`` takes as ``optimizer`` (None: the config's optimizer block)
    base_config: Mapping[str, Any]
    device: torch.device
    world_size: int
    start_step: int
    end_step: int
    cap_bytes: int | None
    train_flops_per_sample: float
    peak_flops_per_device: float | None
    trial_timeout_s: float = 300.0  # how long a collective of a trial may wait (see [Note: failing together])
    sequence_parallel: int = 1  # ranks per sequence-parallel group (they share their samples)

    @property
    def data_parallel(self) -> int:
        """The ranks the global batch splits over."""
        return self.world_size // self.sequence_parallel


def run_trial(setup: TrialSetup, candidate: Candidate) -> TrialResult:
    """Run ``candidate`` (see the module docstring); every rank calls it with the same candidate."""
    from ds_strategy.runtime.initialize import initialize  # the engine: imported when a trial runs

    started = time.perf_counter()
    accelerator = get_accelerator(setup.device.type)
    _release(setup.device)
    base = accelerator.memory_allocated()
    accelerator.reset_peak_memory_stats()
    status, times = OK, []
    failed_at = float("inf")  # wall clock of this rank's error: the first one is the cause, not a peer's wait
    engine: Any = None
    group = _trial_group(setup.trial_timeout_s)
    try:
        with committed_allocations() if setup.device.type == "cpu" else nullcontext():
            model = setup.model_fn()
            if candidate.activation_checkpointing:
                checkpoint_blocks(model)
            config = candidate.to_config(setup.base_config, setup.data_parallel)
            engine, *_ = initialize(
                model=model, optimizer=setup.optimizer, config=config, device=setup.device, process_group=group
            )
            del model
            if engine.coll.fast_path is not None:
                engine.coll.fast_path.timeout = setup.trial_timeout_s
            _release(setup.device)
            accelerator.reset_peak_memory_stats()  # the steps' peak (see [Note: a trial's memory])
            for step in range(setup.end_step):
                began = time.perf_counter()
                for micro in range(candidate.accumulation):
                    batch = to_device(
                        setup.batch_fn(candidate.micro_batch, step * candidate.accumulation + micro), setup.device
                    )
                    if setup.sequence_parallel > 1:
                        batch = shard_if_sequences(batch)  # this rank's slice of each sequence, as in training
                    loss = setup.loss_fn(engine, batch)
                    engine.backward(loss)
                    engine.step()
                accelerator.synchronize()
                times.append(time.perf_counter() - began)
                if _agree(_over(accelerator, base, setup.cap_bytes), setup.device):
                    status = OVER_CAP
                    break
    except torch.OutOfMemoryError:
        status = OUT_OF_MEMORY
    except Exception as err:  # recorded, agreed and reported: the search goes on (see [Note: failing together])
        status, failed_at = f"error: {type(err).__name__}: {err}", time.time()
        log.warning("autotune: trial %s failed: %s", candidate.name, status)
    finally:
        if engine is not None:
            engine.destroy(release_params=status == OK)
        engine = None
        if group is not None:
            dist.destroy_process_group(group)
        peak = _peak(accelerator, base)
        _release(setup.device)
    status, peak_all, step_s = _final_agreement(status, peak, times[setup.start_step :] or times, failed_at)
    result = TrialResult(candidate, status, peak_bytes=peak_all, step_times=times)
    if status == OK and step_s is not None:
        global_batch = candidate.micro_batch * candidate.accumulation * setup.data_parallel
        result.step_s = step_s
        result.samples_per_s = global_batch / step_s
        result.flops_per_s = setup.train_flops_per_sample * result.samples_per_s
        if setup.peak_flops_per_device:
            result.mfu = result.flops_per_s / (setup.peak_flops_per_device * setup.world_size)
    result.wall_s = time.perf_counter() - started
    return result


def warm_up(base_config: Mapping[str, Any], device: torch.device) -> None:
    """Build, step and destroy a small stage-3 engine with the base config's optimizer and precision (see
    [Note: a trial's memory]); every rank calls it."""
    from ds_strategy.runtime.initialize import initialize

    world = dist.get_world_size() if dist.is_initialized() else 1
    config = {k: v for k, v in base_config.items() if k in ("optimizer", "bf16", "fp16", "gradient_clipping")}
    config.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    config.update(train_batch_size=world, train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 3})
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    engine, *_ = initialize(model=model, config=config, device=device)
    dtype = next(engine.module.parameters()).dtype
    loss = engine(torch.ones(1, 16, device=device, dtype=dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.destroy()
    _release(device)


def _trial_group(timeout_s: float) -> Any:
    """A process group of every rank for one trial, its collectives bounded by ``timeout_s`` (None: one
    process, nothing to wait for)."""
    if not _multi_rank():
        return None
    return dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))


def _over(accelerator: Any, base: int, cap: int | None) -> bool:
    return cap is not None and _peak(accelerator, base) > cap


def _peak(accelerator: Any, base: int) -> int:
    peak = accelerator.max_memory_allocated()
    return max(int(peak if peak is not None else accelerator.memory_allocated()) - base, 0)


def _multi_rank() -> bool:
    """Whether the default group has peers to agree with."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_ranks_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Each value's largest over the ranks: one all-reduce over the default group (one process: the values)."""
    if not _multi_rank():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_control_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def _agree(flag: bool, device: torch.device) -> bool:
    """Whether any rank raised ``flag``."""
    return all_ranks_max([1.0 if flag else 0.0], device)[0] > 0


def _final_agreement(
    status: str, peak: int, times: list[float], failed_at: float = float("inf")
) -> tuple[str, int, float | None]:
    """Every rank's (status, peak, median step, time of its error) gathered: the verdict of the most telling
    failure (out of memory, over the cap, an error, in that order; among errors the first raised - its peers
    raised later, timing out while they waited for it - then the lowest rank's), the largest peak and the
    slowest rank's median step time."""
    median = statistics.median(times) if times else None
    if not _multi_rank():
        return status, peak, median if status == OK else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (status, peak, median, failed_at))
    failures = [(_SEVERITY.get(s, 1), -at, -r, s) for r, (s, _, _, at) in enumerate(everyone) if s != OK]
    if failures:
        _, _, minus_rank, worst = max(failures)
        verdict = worst if worst in _SEVERITY else f"rank {-minus_rank}: {worst}"
        return verdict, max(p for _, p, _, _ in everyone), None
    return OK, max(p for _, p, _, _ in everyone), max(m for _, _, m, _ in everyone if m is not None)


_SEVERITY = {OUT_OF_MEMORY: 3, OVER_CAP: 2}  # an error: 1


def _control_device(device: torch.device) -> torch.device:
    """Where the agreement's tensor lives: the default group's backend decides (NCCL wants the GPU)."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return device if backend == "nccl" else torch.device("cpu")


def _release(device: torch.device) -> None:
    """Return a finished trial's memory: cycles collected, the host heap trimmed, the device cache emptied."""
    gc.collect()
    trim_heap()
    if device.type == "cuda":
        torch.cuda.empty_cache()
