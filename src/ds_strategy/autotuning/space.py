"""The search space of the autotuner: which configurations a tune may try, each with the global batch held.

A ``Candidate`` is one point: ZeRO stage, optimizer and parameter offload, activation checkpointing (off, or
every repeated block), micro-batch size, and - outside ``fast`` mode - the bucket sizes, ``overlap_comm`` and
stage 3's prefetch and live-parameter limits. Its gradient accumulation is chosen so that
``micro x accumulation x world size`` is exactly the global batch the user configured: a tuned run trains
with the same batch, so the learning rate needs no rescaling (DeepSpeed's autotuner changes it).

[Note: the global batch held]
The global batch is the base config's ``train_batch_size``, else ``train_micro_batch_size_per_gpu x
gradient_accumulation_steps x world size`` (each 1 when absent). A micro-batch size is a candidate only when
it divides the per-rank batch (global / world size) and lies within ``min/max_train_micro_batch_size_per_gpu``;
``max_train_batch_size`` caps the global batch the user may ask for. ``to_config`` writes all three batch keys
so DeepSpeed's consistency check (train = micro x accumulation x world) holds in the written file.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

OFFLOADS = ("none", "cpu")


@dataclass(frozen=True)
class Candidate:
    """One configuration of a tune (see the module docstring). ``None`` for a knob: the base config's value."""

    stage: int
    micro_batch: int
    accumulation: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    activation_checkpointing: bool = False
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_max_live_parameters: int | None = None

    @property
    def name(self) -> str:
        """A short label for tables and file names: ``z3_off-cpu_ac_mb4``."""
        parts = [f"z{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt-{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"par-{self.offload_param}")
        if self.activation_checkpointing:
            parts.append("ac")
        parts.append(f"mb{self.micro_batch}")
        for key, short in (
            ("reduce_bucket_size", "rb"),
            ("allgather_bucket_size", "ab"),
            ("stage3_prefetch_bucket_size", "pf"),
            ("stage3_max_live_parameters", "live"),
        ):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{short}{_short_number(value)}")
        if self.overlap_comm is not None:
            parts.append("ov" if self.overlap_comm else "noov")
        return "_".join(parts)

    @property
    def group(self) -> tuple[Any, ...]:
        """What it shares with the candidates that differ from it only in micro batch (and accumulation)."""
        return tuple(v for k, v in sorted(self.knobs().items()) if k not in ("micro_batch", "accumulation"))

    def knobs(self) -> dict[str, Any]:
        """The candidate as a flat dict (the results' JSON, the model-based tuner's features)."""
        return asdict(self)

    def to_config(self, base: Mapping[str, Any], world_size: int) -> dict[str, Any]:
        """The base ds_config with this candidate's keys written in (a new dict; ``base`` is not changed). The
        ``autotuning`` block is dropped: the result is a config to train with. ``world_size``: the ranks the
        global batch splits over (the data-parallel ones: ranks / sequence_parallel_size)."""
        out = copy.deepcopy(dict(base))
        out.pop("autotuning", None)
        out["train_micro_batch_size_per_gpu"] = self.micro_batch
        out["gradient_accumulation_steps"] = self.accumulation
        out["train_batch_size"] = self.micro_batch * self.accumulation * world_size
        zero = dict(out.get("zero_optimization") or {})
        zero["stage"] = self.stage
        zero["offload_optimizer"] = {**dict(zero.get("offload_optimizer") or {}), "device": self.offload_optimizer}
        zero["offload_param"] = {**dict(zero.get("offload_param") or {}), "device": self.offload_param}
        for key in (
            "reduce_bucket_size",
            "allgather_bucket_size",
            "overlap_comm",
            "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters",
        ):
            value = getattr(self, key)
            if value is not None:
                zero[key] = value
        out["zero_optimization"] = zero
        return out


@dataclass(frozen=True)
class SearchSpace:
    """What a tune may vary. Every field is a tuple of choices; invalid combinations (offload at stage 0,
    parameter offload below stage 3, stage-3 knobs at stages 0-2) are never generated.

    ``micro_batches``: None picks from the divisors of the per-rank batch within the ``autotuning`` block's
    min/max (see [Note: the global batch held]). The bucket / overlap / prefetch / live choices are tried only
    outside ``fast`` mode (``autotuning.fast = false``); ``None`` among them means the base config's value."""

    stages: tuple[int, ...] = (0, 1, 2, 3)
    offload_optimizer: tuple[str, ...] = OFFLOADS
    offload_param: tuple[str, ...] = ("none",)
    activation_checkpointing: tuple[bool, ...] = (False, True)
    micro_batches: tuple[int, ...] | None = None
    reduce_bucket_size: tuple[int | None, ...] = (None, 50_000_000)
    allgather_bucket_size: tuple[int | None, ...] = (None,)
    overlap_comm: tuple[bool | None, ...] = (None, False)
    stage3_prefetch_bucket_size: tuple[int | None, ...] = (None,)
    stage3_max_live_parameters: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        for stage in self.stages:
            if stage not in (0, 1, 2, 3):
                raise ValueError(f"SearchSpace.stages: got {stage!r}; expected ZeRO stages among 0, 1, 2, 3")
        for key in ("offload_optimizer", "offload_param"):
            for device in getattr(self, key):
                if device not in OFFLOADS:
                    raise ValueError(
                        f"SearchSpace.{key}: got {device!r}; expected among {OFFLOADS} "
                        "(NVMe offload is not tuned: its speed depends on the disk, set it yourself)"
                    )
        if self.micro_batches is not None and any(int(m) < 1 for m in self.micro_batches):
            raise ValueError(f"SearchSpace.micro_batches: got {self.micro_batches}; expected positive integers")


def global_batch(base: Mapping[str, Any], world_size: int) -> int:
    """The global batch a tune holds (see [Note: the global batch held])."""
    given = base.get("train_batch_size")
    if given is not None:
        return int(given)
    micro = int(base.get("train_micro_batch_size_per_gpu") or 1)
    accumulation = int(base.get("gradient_accumulation_steps") or 1)
    return micro * accumulation * world_size


def micro_batch_choices(per_rank: int, lowest: int, highest: int, explicit: Sequence[int] | None) -> list[int]:
    """Micro-batch sizes that divide ``per_rank`` within [lowest, highest] (or the explicit ones that divide
    it), ascending."""
    pool = explicit if explicit is not None else range(lowest, min(highest, per_rank) + 1)
    return sorted({int(m) for m in pool if lowest <= int(m) <= highest and per_rank % int(m) == 0})


def candidates(space: SearchSpace, micro_batches: Sequence[int], per_rank: int, *, fast: bool) -> Iterator[Candidate]:
    """Every valid candidate of ``space`` for the given micro-batch sizes, in a stable order (stage, offload,
    checkpointing, micro batch, then the non-fast knobs)."""
    tuned: list[tuple[str, tuple[Any, ...]]] = []
    if not fast:
        tuned = [
            ("reduce_bucket_size", space.reduce_bucket_size),
            ("allgather_bucket_size", space.allgather_bucket_size),
            ("overlap_comm", space.overlap_comm),
            ("stage3_prefetch_bucket_size", space.stage3_prefetch_bucket_size),
            ("stage3_max_live_parameters", space.stage3_max_live_parameters),
        ]
    for stage, opt, par, ac, micro in itertools.product(
        space.stages, space.offload_optimizer, space.offload_param, space.activation_checkpointing, micro_batches
    ):
        if stage == 0 and opt != "none":
            continue  # stage 0 keeps the optimizer state on every rank: nothing to offload
        if stage != 3 and par != "none":
            continue  # only stage 3 partitions (and so offloads) the parameters
        base = Candidate(stage, micro, per_rank // micro, opt, par, ac)
        if not tuned:
            yield base
            continue
        seen: set[Candidate] = set()
        for values in itertools.product(*(choices for _, choices in tuned)):
            knobs = dict(zip((k for k, _ in tuned), values, strict=True))
            if stage != 3:
                knobs["stage3_prefetch_bucket_size"] = knobs["stage3_max_live_parameters"] = None
            if stage in (0, 3):
                knobs["allgather_bucket_size"] = None  # read at stages 1-2 only
            candidate = replace(base, **knobs)
            if candidate not in seen:
                seen.add(candidate)
                yield candidate


def _short_number(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"
