"""The interface every ZeRO stage implements, and the machinery they share.

[Note: gradient hooks and bucket order]
``Tensor.register_post_accumulate_grad_hook`` fires once per backward for every trainable parameter,
after autograd has summed all its contributions (tied weights included). The hook moves ``p.grad`` into
the stage's buffer (the full accumulation buffer of stages 0-1, or a bucket staging buffer in stage 2)
and sets ``p.grad = None``, so autograd's gradient is freed at once.

During a *reducing pass* (stage 2: every backward; stages 0-1: the backward of the accumulation
boundary) each completed bucket is reduced while backward goes on. Collectives must be issued in the
same order on every rank, whatever order gradients arrive in, so buckets are launched strictly in one
agreed order: a pointer walks that order and, whenever the bucket under it is complete, launches it and
every consecutive complete bucket after it (the schedule is ``GradientReducer``'s, reducer.py: the stage
reports arrivals, the reducer launches through the stage). ``end_backward`` launches what is left (buckets holding
parameters that got no gradient this time, zero-filled) and waits for all of them. The agreed order
sorts buckets by the registration index of their earliest-registered parameter, descending: the order
in which backward completes them.

A step needs the whole window's gradients reduced. If the boundary backward did not reduce (inside
``no_sync``, or ``loss.backward()`` called directly instead of ``engine.backward``), ``prepare_step``
runs one reducing pass over everything before the optimizer looks at gradients.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..host_memory import trim_heap
from ..layout import BucketKey
from ..precision import Precision
from ..swap import OptimizerSwapper, Swap, make_swap
from .buffers import GroupState, GroupStorage
from .collectives import Collectives, Handle
from .init import init_shard
from .intake import GradientIntake, GradStatus
from .offload import Offload
from .partial_offload import MasterSplit
from .per_tensor import WholeTensors, log_padding
from .placement import WholeParameters
from .reducer import GradientReducer
from .step import OptimizerStep

__all__ = ["BucketKey", "GradStatus", "StageOptions", "ZeroStage", "averaging"]


@dataclass(frozen=True)
class StageOptions:
    """What a stage needs to know beyond its parameters; each stage builds its own from the config
    (``ZeroStage.options_from``)."""

    bucket_numel: int
    compute_dtype: torch.dtype = torch.float32
    accum_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype = torch.float32
    master_device: torch.device | None = None  # None: the parameters' device
    async_comm: bool = True
    pre_scale: float = 1.0  # gradients are multiplied by this before the collective ...
    post_scale: float = 1.0  # ... and by this after it (folded into the step's unscale)
    pin_memory: bool = False
    sub_group_numel: int = 1_000_000_000  # zero_optimization.sub_group_size: see ``OptimizerStep.tiles``
    device: torch.device | None = None  # the compute device (None: the first parameter's device)
    offload: Offload = field(default_factory=Offload)
    # Per param group, the communicator reducing, partitioning and gathering it (None: the stage's own data-
    # parallel one). Expert groups of an MoE model use their expert-data-parallel group: see [Note: a
    # param group's reduction group] in runtime/moe/params.py. Empty: every group uses the stage's.
    group_comms: tuple[Collectives | None, ...] = ()
    # Per param group: a per-tensor optimizer steps its parameters whole, so every bucket assigns them to
    # ranks whole ([Note: whole parameters per rank] in runtime/layout.py; the tensors: per_tensor.py).
    # Empty: no group (an element-wise optimizer).
    whole_params: tuple[bool, ...] = ()

    def whole(self, group: int) -> bool:
        """Whether param group ``group`` is laid out with whole parameters per rank."""
        return group < len(self.whole_params) and self.whole_params[group]


class ZeroStage:
    """A ZeRO stage: owns the flat buffers and the reductions into them. The parts it delegates, each an
    object of its own: the gradient hooks and arrival state (``intake``, intake.py), the reduction schedule
    (``reducer``, reducer.py), the optimizer step (``stepper``, step.py; the norm: grad_norm.py) and where
    the compute-dtype parameters live (``placement``, placement.py)."""

    stage: int = -1
    partitioned: bool = False  # masters/optimizer state hold only this rank's shards
    reduces_every_backward: bool = False  # stage 2: gradients leave for their owner every micro-step
    places_its_parameters: bool = False  # stage 3 moves its trainable parameters to the device itself
    # The config keys bounding a bucket (the smallest wins): stage 0 gathers nothing and stage 3 gathers by
    # unit, so DeepSpeed reads ``allgather_bucket_size`` only at stages 1-2.
    bucket_keys: tuple[str, ...] = ("reduce_bucket_size",)
    always_overlaps: bool = False  # reductions overlap backward whatever ``overlap_comm`` says (stage 0)
    # Partitioned stages divide by the world size before the sum, as DeepSpeed's ZeRO 1-3 (and DDP) do: an
    # fp16 sum of W scaled gradients can overflow where their mean does not. Stage 0 sums first (DeepSpeed's).
    predivides: bool = True

    @classmethod
    def options_from(
        cls, config: Any, *, precision: Precision, device: torch.device, world_size: int, offload: Offload
    ) -> StageOptions:
        """This stage's options from the config."""
        zero = config.zero_optimization
        pre, post = averaging(config, world_size, predivide=cls.predivides)
        return StageOptions(
            bucket_numel=int(min(getattr(zero, key) for key in cls.bucket_keys)),
            compute_dtype=precision.compute_dtype,
            accum_dtype=precision.accum_dtype,
            comm_dtype=precision.comm_dtype,
            master_device=offload.master_device(device),
            async_comm=cls.always_overlaps or bool(zero.overlap_comm),
            pre_scale=pre,
            post_scale=post,
            pin_memory=offload.pin_masters(device),
            sub_group_numel=int(zero.sub_group_size),
            device=device,
            offload=offload,
        )

    def __init__(
        self,
        groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
        registration: dict[nn.Parameter, int],
        *,
        coll: Collectives,
        options: StageOptions,
    ) -> None:
        self.coll = coll
        self.options = options
        # NVMe offload: the swap files are made (and the disk checked) before any partition is built.
        self.swap: Swap | None = make_swap(
            options.offload,
            rank=coll.rank,
            stage=self.stage,
            partition_numel=-(-sum(_true_numel(p) for named in groups for _, p in named) // coll.world_size),
            compute_dtype=options.compute_dtype,
        )
        self.swapper: OptimizerSwapper | None = self.swap.optimizer if self.swap is not None else None
        self._resident_depth = 0
        self.groups: list[GroupStorage] = [self._make_group(g, named) for g, named in enumerate(groups)]
        self.swapped: list[GroupStorage] = list(self.groups)  # what a ``resident`` block brings in
        # Where collectives of control data (the gradient norm) run: not a group's device, which an empty
        # first group leaves at the host default.
        first_device = next((p.device for named in groups for _, p in named), None)
        self.compute_device: torch.device = options.device or first_device or torch.device("cpu")
        # offload_optimizer.ratio < 1: part of the masters back to the compute device (partial_offload.py)
        self.master_split = MasterSplit.place(self.groups, options.offload, self.compute_device, rank=coll.rank)
        # A per-tensor optimizer's shaped tensors inside the masters ([Note: per-tensor optimizers under ZeRO]).
        self.whole: WholeTensors | None = None
        if any(options.whole_params):
            self.whole = WholeTensors(self.groups, options.whole_params)
            log_padding(self.groups, self.whole)
        first = {
            (g, b.index): min(registration[gs.params[i]] for i in b.params)
            for g, gs in enumerate(self.groups)
            for b in gs.layout.buckets
        }
        self.bucket_order: list[BucketKey] = sorted(first, key=lambda k: (-first[k], k))
        first_pid = [sum(len(gs.params) for gs in self.groups[:g]) for g in range(len(self.groups))]
        bucket_pids = {
            (g, b.index): [first_pid[g] + i for i in b.params]
            for g, gs in enumerate(self.groups)
            for b in gs.layout.buckets
        }
        numel_of = {(g, b.index): b.padded for g, gs in enumerate(self.groups) for b in gs.layout.buckets}
        self.reducer = GradientReducer(
            self, self.bucket_order, bucket_pids, numel_of, self.options.bucket_numel,
            every_backward=self.reduces_every_backward,
        )  # fmt: skip
        self.intake = GradientIntake(self, self.reducer, count_buckets=self.places_its_parameters)
        self.stepper = OptimizerStep(self)  # the optimizer step (step.py)
        self.placement = WholeParameters(self.groups, coll)
        self._allocate()
        if self.swap is not None:
            trim_heap()  # the build's freed blocks ([Note: host memory under NVMe offload], runtime/swap)

    @classmethod
    def create(
        cls,
        groups: Sequence[Sequence[tuple[str, nn.Parameter]]],
        registration: dict[nn.Parameter, int],
        *,
        coll: Collectives,
        options: StageOptions,
        module: nn.Module,
        config: Any,
    ) -> ZeroStage:
        """What the engine calls: stages needing more than their parameters (stage 3: the module's
        hooks and its ``stage3_*`` keys) override this; the others ignore ``module`` and ``config``."""
        return cls(groups, registration, coll=coll, options=options)

    def _make_group(self, index: int, named: Sequence[tuple[str, nn.Parameter]]) -> GroupStorage:
        """The storage of one param group (stage 3 keeps only this rank's shards)."""
        for name, p in named:
            if getattr(p, "_ds_init_shard", None) is not None:
                raise ValueError(
                    f"parameter {name!r} was partitioned by ds_strategy.zero.Init, which only ZeRO stage 3 "
                    "trains; set zero_optimization.stage to 3 or build the model without zero.Init"
                )
        device = named[0][1].device if named else torch.device("cpu")
        return GroupState(
            index,
            named,
            coll=self.comm_of(index),
            bucket_numel=self.options.bucket_numel,
            compute_dtype=self.options.compute_dtype,
            master_device=self.options.master_device or device,
            partitioned=self.partitioned,
            pin_memory=self.options.pin_memory,
            master_swap=self.swapper,
            whole_params=self.options.whole(index),
        )

    def comm_of(self, group: int) -> Collectives:
        """The communicator that reduces, partitions and gathers param group ``group``."""
        comms = self.options.group_comms
        comm = comms[group] if group < len(comms) else None
        return self.coll if comm is None else comm

    frozen: Sequence[GroupStorage] = ()  # stage 3 partitions frozen parameters too (stage3.py)

    # ------------------------------------------------------------------ stage-specific parts
    def _allocate(self) -> None:
        """The stage's gradient buffers, made once the storages, schedule and hooks' state exist."""

    def grad_target(self, group: int, index: int) -> torch.Tensor:
        """Where parameter ``index`` of ``group`` accumulates its gradient (the intake copies it there)."""
        raise NotImplementedError

    def launch_reduction(self, key: BucketKey) -> Handle:
        """Issue the collective of one bucket; return a handle whose wait() lands the result."""
        raise NotImplementedError

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]:
        """The reduced (still scaled: x ``pre_scale * loss scale``) gradient of ``groups[group]``, one piece
        per master, valid while the intake's ``status()`` is ``REDUCED``."""
        raise NotImplementedError

    def late_buffer(self, key: BucketKey) -> torch.Tensor:
        """A zeroed bucket-shaped buffer for gradients that arrive after their bucket was launched."""
        raise NotImplementedError

    def reduce_late(self, key: BucketKey, late: torch.Tensor) -> None:
        """Reduce ``late`` as ``launch_reduction`` reduced the bucket and add the result to the bucket's."""
        raise NotImplementedError

    def _reduce_scatter_add(self, out: torch.Tensor, send: torch.Tensor, group: int = 0) -> None:
        """``out += reduce_scatter(send * pre_scale)`` over param group ``group``'s communicator (stages 1-3:
        the late part of a partition gradient)."""
        if self.options.pre_scale != 1.0:
            send.mul_(self.options.pre_scale)
        result = torch.empty(out.numel(), dtype=send.dtype, device=send.device)
        self._reduce_scatter(result, send, group=group)
        out.add_(result.to(out.dtype))

    def _reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, *, group: int = 0, async_op: bool = False
    ) -> Handle:
        """Every gradient reduce-scatter of stages 1-3 (``input`` is scratch), over param group ``group``'s
        communicator; stage 3's qgZ replaces it."""
        return self.comm_of(group).reduce_scatter(output, input, async_op=async_op)

    def _reset_window(self) -> None:
        """Forget the accumulated gradients (after a step or zero_grad)."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per kind: params, grads, master (optimizer state is the engine's)."""
        params = sum(gs.numel_bytes()["params"] for gs in self.groups)
        master = sum(gs.numel_bytes()["master"] for gs in self.groups)
        master += self.master_split.device_master_bytes() if self.master_split is not None else 0
        host = self.stepper.host_grad_bytes()
        return {"params": params, "grads": host, "master": master}

    # ------------------------------------------------------------------ backward
    def attach(self) -> None:
        """Hook the trainable parameters (the engine, once its optimizer exists)."""
        self.intake.attach()

    def detach(self) -> None:
        self.intake.detach()

    def bucket_complete(self, key: BucketKey) -> None:
        """Every gradient this pass expects for ``key`` has arrived (stage 3 frees its gathered bucket)."""

    def begin_backward(self, *, reduce: bool) -> None:
        """Called by the engine before ``loss.backward()``; ``reduce``: this backward ends the window."""
        self.reducer.begin_backward(reduce=reduce)

    def end_backward(self, *, failed: bool = False) -> None:
        """Called by the engine after ``loss.backward()``: finish the reducing pass, if any. ``failed``: the
        backward raised, so the pass is dropped without a collective (the window's gradients are lost;
        nothing waits for the reductions in flight, whose peers may be gone)."""
        if failed:
            self.reducer.abandon_pass()
        else:
            self.reducer.end_backward()
        self.intake.end_backward()

    # ------------------------------------------------------------------ the optimizer step
    @property
    def masters(self) -> list[list[nn.Parameter]]:
        """Per param group, the fp32 tensors that hold the masters (one per bucket)."""
        return [gs.masters for gs in self.groups]

    @torch.no_grad()
    def publish(self, params_written: Collection[int] = ()) -> None:
        """Masters -> compute-dtype parameters (except groups whose optimizer pass already wrote them),
        then (partitioned stages) all-gather every bucket."""
        for g, gs in enumerate(self.groups):
            if g not in params_written:
                gs.copy_masters_to_params()
        if not self.partitioned:
            return
        handles = []
        for g, b in self.bucket_order:
            gs = self.groups[g]
            assert isinstance(gs, GroupState)  # stages 1-2 keep flat buffers (stage 3 publishes its own way)
            bucket = gs.layout.bucket_view(gs.flat, b)
            comm = self.comm_of(g)
            mine = gs.layout.shard_view(gs.flat, b, comm.rank)
            handles.append(comm.all_gather(bucket, mine, async_op=self.options.async_comm))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        """Drop the accumulated gradients: the next backward starts a new window."""
        self.reducer.reset()  # keep ranks in step: a started pass is always completed
        self.intake.reset()
        self._reset_window()

    # ------------------------------------------------------------------ NVMe offload
    @contextmanager
    def resident(self) -> Iterator[None]:
        """Within the block every swapped master, optimizer state, gradient and partition is in host memory,
        as with CPU offload (checkpoints and the full-state access read and write them there); written back
        to the swap files when it ends. Without NVMe offload it does nothing."""
        if self.swap is None:
            yield
            return
        self._resident_depth += 1
        try:
            if self._resident_depth == 1:
                if self.swapper is not None:
                    self.swapper.swap_in_all()
                for gs in self.swapped:
                    gs.materialize()
            yield
        finally:
            self._resident_depth -= 1
            if self._resident_depth == 0:
                for gs in self.swapped:
                    gs.dematerialize()
                if self.swapper is not None:
                    self.swapper.swap_out_all()

    def close(self) -> None:
        """Release what this stage created: its swap files (the engine's destroy; at exit otherwise)."""
        if self.swap is not None:
            self.swap.close()


def _true_numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also when zero.Init left only this rank's shard of it."""
    info = init_shard(p)
    return info.numel if info is not None else p.numel()


def averaging(config: Any, world_size: int, *, predivide: bool) -> tuple[float, float]:
    """(factor before, factor after) the gradient sum across ranks. prescale_gradients divides by W before.
    Otherwise, with gradient_predivide_factor f: ``predivide`` (ZeRO 1-3, DeepSpeed's reduce-scatter path)
    by f*W before and f after; else (stage 0, DeepSpeed's allreduce_bucket) by f before and W/f after.
    gradient_allreduce_op "sum" skips the averaging."""
    f = config.gradient_predivide_factor
    if config.gradient_allreduce_op == "sum":
        return 1.0 / f, f
    if config.prescale_gradients:
        return 1.0 / world_size, 1.0
    if predivide:
        return 1.0 / (f * world_size), f
    return 1.0 / f, f / world_size
