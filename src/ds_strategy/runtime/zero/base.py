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

import enum
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_strategy.accelerator.spans import span
from ds_strategy.ops import multi_tensor_l2norm
from ds_strategy.ops.norm import multi_tensor_sum_of_squares

from ..host_memory import trim_heap
from ..precision import Precision
from ..swap import OptimizerSwapper, Swap, make_swap
from .buffers import GroupState, GroupStorage
from .collectives import Collectives, Handle
from .init import init_shard
from .offload import Offload
from .reducer import GradientReducer
from .step import OptimizerStep

BucketKey = tuple[int, int]  # (group index, bucket index)


class GradStatus(enum.Enum):
    """Where the current accumulation window's gradients stand (``ZeroStage.gradient_status``)."""

    IN_BACKWARD = "a backward is running"
    NONE = "no gradient since the last step"
    PENDING = "accumulated, not reduced yet"  # stages 0-1 inside a window; a backward outside engine.backward
    REDUCED = "reduced"  # the boundary backward reduced them (stages 2-3: every backward does)


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
    sub_group_numel: int = 1_000_000_000  # zero_optimization.sub_group_size: see ``step_tiles``
    device: torch.device | None = None  # the compute device (None: the first parameter's device)
    offload: Offload = field(default_factory=Offload)
    # Per param group, the communicator reducing, partitioning and gathering it (None: the stage's own data-
    # parallel one). Expert groups of an MoE model use their expert-data-parallel group: see [Note: a
    # param group's reduction group] in runtime/moe/params.py. Empty: every group uses the stage's.
    group_comms: tuple[Collectives | None, ...] = ()


class ZeroStage:
    """A ZeRO stage: owns the flat buffers, the gradient hooks, the reductions and the post-step gather."""

    stage: int = -1
    partitioned: bool = False  # masters/optimizer state hold only this rank's shards
    reduces_every_backward: bool = False  # stage 2: gradients leave for their owner every micro-step
    places_its_parameters: bool = False  # stage 3 moves its trainable parameters to the device itself

    @classmethod
    def options_from(
        cls, config: Any, *, precision: Precision, device: torch.device, world_size: int, offload: Offload
    ) -> StageOptions:
        """This stage's options from the config (``bucket_numel`` and ``async_comm`` are per stage)."""
        zero = config.zero_optimization
        pre, post = averaging(config, world_size)
        return StageOptions(
            bucket_numel=cls.bucket_numel(zero),
            compute_dtype=precision.compute_dtype,
            accum_dtype=precision.accum_dtype,
            comm_dtype=precision.comm_dtype,
            master_device=offload.master_device(device),
            async_comm=cls.async_comm(zero),
            pre_scale=pre,
            post_scale=post,
            pin_memory=offload.pin_masters(device),
            sub_group_numel=int(zero.sub_group_size),
            device=device,
            offload=offload,
        )

    @classmethod
    def bucket_numel(cls, zero: Any) -> int:
        """Elements per bucket of the flat layout: ``reduce_bucket_size`` (stage 0 gathers nothing, stage 3
        gathers by module; DeepSpeed reads ``allgather_bucket_size`` only at stages 1-2)."""
        return int(zero.reduce_bucket_size)

    @classmethod
    def async_comm(cls, zero: Any) -> bool:
        """Whether reductions overlap backward: ``overlap_comm``."""
        return bool(zero.overlap_comm)

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
        # Where collectives of control data (the gradient norm) run: not a group's device, which an empty
        # first group leaves at the host default.
        first_device = next((p.device for named in groups for _, p in named), None)
        self.compute_device: torch.device = options.device or first_device or torch.device("cpu")
        # Per parameter: (group, index in layout); per bucket: its parameter count.
        self._where: list[tuple[int, int]] = [(g, i) for g, gs in enumerate(self.groups) for i in range(len(gs.params))]
        self._first_pid = [sum(len(gs.params) for gs in self.groups[:g]) for g in range(len(self.groups))]
        self._params: list[nn.Parameter] = [self.groups[g].params[i] for g, i in self._where]
        first = {
            (g, b.index): min(registration[gs.params[i]] for i in b.params)
            for g, gs in enumerate(self.groups)
            for b in gs.layout.buckets
        }
        self.bucket_order: list[BucketKey] = sorted(first, key=lambda k: (-first[k], k))
        self._written = [False] * len(self._params)
        self._got_grad = [False] * len(self._params)  # in this accumulation window (ignore_unused_parameters)
        self._hooks: list[RemovableHandle] = []
        bucket_pids = {
            (g, b.index): [self._first_pid[g] + i for i in b.params]
            for g, gs in enumerate(self.groups)
            for b in gs.layout.buckets
        }
        numel_of = {(g, b.index): b.padded for g, gs in enumerate(self.groups) for b in gs.layout.buckets}
        self.reducer = GradientReducer(
            self, self.bucket_order, bucket_pids, numel_of, self.options.bucket_numel,
            every_backward=self.reduces_every_backward,
        )  # fmt: skip
        self.stepper = OptimizerStep(self)  # the optimizer step (step.py)
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
        )

    def comm_of(self, group: int) -> Collectives:
        """The communicator that reduces, partitions and gathers param group ``group``."""
        comms = self.options.group_comms
        comm = comms[group] if group < len(comms) else None
        return self.coll if comm is None else comm

    frozen: Sequence[GroupStorage] = ()  # stage 3 partitions frozen parameters too (stage3.py)

    def refresh_frozen(self) -> None:
        """After frozen partitions were overwritten: bring their gathered copies up to date (stage 3)."""

    def stored_params(self) -> list[nn.Parameter]:
        """The parameters whose storage this stage owns (the others - frozen ones below stage 3 - stay the
        module's, replicated)."""
        return [p for gs in self.groups for p in gs.params]

    def forward_context(self) -> AbstractContextManager[None]:
        """Wraps the engine's forward (stage 3 adds a hint to errors from partitioned parameters)."""
        return nullcontext()

    @torch.no_grad()
    def full_state_dict(self, module: nn.Module, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The module's full state dict in the compute dtype, copied to the CPU of ``rank`` (of every rank
        when None; the other ranks get ``{}``). Every rank must call it (stage 3 gathers)."""
        if rank is not None and self.coll.rank != rank:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def release_params(self) -> None:
        """Before the engine is destroyed: leave the parameters usable by a later engine. Stages 0-2 have
        nothing to do (the module keeps its flat-buffer parameters); stage 3 overrides it."""

    # The hybrid engine's one-time gather (runtime/hybrid.py); stages 0-2 hold whole parameters already.
    def partitioned_numel(self) -> int:
        """Elements a gather of every partitioned parameter holds (stage 3: its non-persistent buckets)."""
        return 0

    def hold_gathered(self, in_flight: int) -> None:
        """Gather every partitioned parameter once and keep it gathered until ``release_held`` (stage 3)."""

    def release_held(self) -> None:
        """End ``hold_gathered``: the partitioned parameters are freed again."""

    @property
    def holding(self) -> bool:
        return False

    def unhook_inside(self, regions: Sequence[nn.Module]) -> None:
        """Compiled regions (runtime/compile.py): stages 0-2 hook no module, so there is nothing to remove."""

    def release_caches(self) -> None:
        """Return cached buffers of gathered parameters (stage 3's host pool)."""

    # ------------------------------------------------------------------ stage-specific parts
    def _target(self, group: int, index: int) -> torch.Tensor:
        """Where parameter ``index`` of ``group`` accumulates its gradient."""
        raise NotImplementedError

    def launch_reduction(self, key: BucketKey) -> Handle:
        """Issue the collective of one bucket; return a handle whose wait() lands the result."""
        raise NotImplementedError

    def _grad_pieces(self, group: int) -> list[torch.Tensor]:
        """The reduced (still scaled) gradient lined up with ``groups[group].masters``."""
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
        host = self.stepper.host_grad_bytes()
        return {"params": params, "grads": host, "master": master}

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        for pid, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(pid)))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook_for(self, pid: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if torch.is_grad_enabled():  # backward(create_graph=True); a plain backward runs without grad mode
                with torch.no_grad():
                    self._on_grad(pid, param)
            else:  # no decorator: a no_grad context per gradient costs microseconds in the autograd thread
                self._on_grad(pid, param)

        return hook

    def _on_grad(self, pid: int, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        g, i = self._where[pid]
        reducer = self.reducer
        if reducer.reduced and not self.reduces_every_backward:
            raise RuntimeError(
                f"a gradient for {self.groups[g].names[i]!r} arrived after this step's gradients were already "
                "reduced; call engine.step() after the boundary backward before running another backward"
            )
        if not reducer.in_backward:
            reducer.unmanaged = True
        key = (g, self.groups[g].layout.params[i].bucket)
        expected = True
        if reducer.reducing:
            expected = reducer.arrive(pid)
            if not expected and reducer.launched(key):
                self._add_late(key, g, i, grad)
                if reducer.through(key, pid):
                    self.bucket_complete(key)  # every parameter of the bucket is through this extra backward
                return
        self._got_grad[pid] = True
        target = self._target(g, i)
        if self._written[pid]:
            target.add_(grad.view_as(target))
        else:
            target.copy_(grad.view_as(target))
            self._written[pid] = True
        if reducer.reducing and expected:
            reducer.expected_arrived(key)

    def _add_late(self, key: BucketKey, g: int, i: int, grad: torch.Tensor) -> None:
        """[Note: a hook that fires twice] Reentrant activation checkpointing runs one backward per
        checkpointed call, so a parameter used in two of them (a shared layer, a block called twice) gets
        its hook once per call. The pass expects as many calls as the last reducing backward had; a call
        beyond that whose bucket was already launched is kept here and reduced on its own at the end of the
        pass (the reductions are linear: reduce(a) + reduce(b) = reduce(a + b)). The next pass expects the
        new count and reduces the bucket once, after its last call."""
        layout = self.groups[g].layout
        slot, bucket = layout.params[i], layout.buckets[layout.params[i].bucket]
        late = self.reducer.late_buffer_for(key)
        late[slot.offset - bucket.start : slot.end - bucket.start].add_(grad.reshape(-1).to(late.dtype))

    def bucket_complete(self, key: BucketKey) -> None:
        """Every gradient this pass expects for ``key`` has arrived (stage 3 frees its gathered bucket)."""

    # ------------------------------------------------------------------ reducing passes
    def begin_backward(self, *, reduce: bool) -> None:
        """Called by the engine before ``loss.backward()``; ``reduce``: this backward ends the window."""
        self.reducer.begin_backward(reduce=reduce)

    def end_backward(self) -> None:
        """Called by the engine after ``loss.backward()``: finish the reducing pass, if any."""
        self.reducer.end_backward()

    def _zero_unwritten(self, key: BucketKey, buffer: torch.Tensor) -> None:
        """Zero the parts of a bucket-shaped buffer whose parameters got no gradient in this window."""
        g, b = key
        layout = self.groups[g].layout
        start = layout.buckets[b].start
        for i in layout.buckets[b].params:
            pid = self._pid(g, i)
            if not self._written[pid]:
                slot = layout.params[i]
                buffer[slot.offset - start : slot.end - start].zero_()

    def _pid(self, group: int, index: int) -> int:
        return self._first_pid[group] + index

    # ------------------------------------------------------------------ the optimizer step
    @property
    def masters(self) -> list[list[nn.Parameter]]:
        """Per param group, the fp32 tensors the optimizer steps (one per bucket)."""
        return [gs.masters for gs in self.groups]

    def prepare_step(self) -> None:
        """Make sure the window's gradients are fully reduced (see [Note: gradient hooks and bucket order])."""
        self.reducer.catch_up()

    def gradient_status(self) -> GradStatus:
        """Where this window's gradients stand (read by the full-state access of ``access.py``)."""
        if self.reducer.in_backward:
            return GradStatus.IN_BACKWARD
        if not any(self._got_grad):
            return GradStatus.NONE
        if self.reducer.unmanaged or (not self.reduces_every_backward and not self.reducer.reduced):
            return GradStatus.PENDING
        return GradStatus.REDUCED

    def reduced_grads_of(self, group: int) -> list[torch.Tensor]:
        """The reduced (still scaled: x ``pre_scale * loss scale``) gradient of ``groups[group]``, one piece
        per master, valid while ``gradient_status()`` is ``REDUCED``."""
        return self._grad_pieces(group)

    def _reduced_grads(self) -> list[torch.Tensor]:
        """This rank's reduced (still scaled) gradients, on the parameters' device, all groups."""
        return [t for g in range(len(self.groups)) for t in self._grad_pieces(g)]

    def grad_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(L2 norm, any inf/nan) of the reduced gradients of every rank, agreed by all ranks: 0-dim tensors
        on the compute device (fp64 norm, fp32 flag 1.0/0.0), never read on the host (see [Note: the step
        on the device]).

        Still scaled: the engine divides by the loss scale and averaging factor. Stages 1-2 combine the
        per-rank squares with one all-reduce of ``[norm**2, found_inf]``.
        """
        with span("ds::grad_norm"):
            return self._grad_norm()

    def _grad_norm(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.swapper is not None and self.swapper.grad_of:  # NVMe: the gradients stream in tile by tile
            total, found = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float32)
            for grads in self.swapper.stream_grads(self.stepper.tiles()):  # host memory: no device read
                sq, inf = multi_tensor_sum_of_squares(grads)
                total += sq
                found = torch.maximum(found, inf.float())
            norm, found_inf = total.sqrt().float(), found
        elif self.options.group_comms:
            return self._grad_norm_over_groups()
        else:
            norm, found_inf = multi_tensor_l2norm(self._reduced_grads())
        if self.partitioned and self.coll.world_size > 1:
            both = torch.stack([norm.float() ** 2, found_inf.float()]).to(self.compute_device)
            self.coll.all_reduce(both)
            sq, inf = both[0], both[1]
            return sq.double().sqrt(), ((inf > 0) | ~torch.isfinite(sq)).float()
        norm = norm.to(self.compute_device)  # a rank with no gradient at all has a host zero
        return norm.double(), ((found_inf.to(norm.device) > 0) | ~torch.isfinite(norm)).float()

    def _grad_norm_over_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The global norm when param groups reduce over different communicators (an MoE model's experts).

        Every element of the model's gradient is counted once: a partitioned group's shards are disjoint
        across its communicator, and the communicators of the expert groups of one ``ep_size`` hold disjoint
        experts, so summing the squares over the whole data-parallel group counts each once; a replicated
        group (stage 0) is held by each of its communicator's ranks, so its square is weighted by
        ``1 / its size``. One all-reduce of ``[weighted norm**2, found_inf]`` (fp64) over the stage's group.
        """
        both = torch.zeros(2, dtype=torch.float64, device=self.compute_device)
        for g in range(len(self.groups)):
            pieces = self._grad_pieces(g)
            if not pieces:
                continue
            norm, inf = multi_tensor_l2norm(pieces)
            weight = 1.0 if self.partitioned else 1.0 / self.comm_of(g).world_size
            both[0] += (norm.double() ** 2 * weight).to(both.device)
            both[1] += inf.double().to(both.device)
        if self.coll.world_size > 1:
            self.coll.all_reduce(both)
        sq, inf = both[0], both[1]
        return sq.sqrt(), ((inf > 0) | ~torch.isfinite(sq)).float()

    def skip_mode(self, optimizer: torch.optim.Optimizer) -> str:
        """How ``apply_step`` learns whether to skip a step (``OptimizerStep.skip_mode``, step.py)."""
        return self.stepper.skip_mode(optimizer)

    def apply_step(
        self,
        optimizer: torch.optim.Optimizer,
        factor: float,
        *,
        clip: torch.Tensor | None = None,
        skip: torch.Tensor | None = None,
    ) -> bool | None:
        """The optimizer step (``OptimizerStep.apply`` in step.py: [Note: the fused optimizer pass], [Note:
        the step on the device]); whether it was skipped where the host learned it, None where only the
        device knows."""
        return self.stepper.apply(optimizer, factor, clip=clip, skip=skip)

    def step_tiles(self) -> list[set[nn.Parameter]]:
        """The masters in optimizer-step tiles of at most ``sub_group_size`` elements (step.py)."""
        return self.stepper.tile_sets()

    # ------------------------------------------------------------------ NVMe offload
    def swapped_storages(self) -> list[GroupStorage]:
        """The storages whose partitions a ``resident`` block brings in (stage 3 adds its frozen ones)."""
        return list(self.groups)

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
                for gs in self.swapped_storages():
                    gs.materialize()
            yield
        finally:
            self._resident_depth -= 1
            if self._resident_depth == 0:
                for gs in self.swapped_storages():
                    gs.dematerialize()
                if self.swapper is not None:
                    self.swapper.swap_out_all()

    def close_swap(self) -> None:
        """Remove this stage's swap files (the engine's destroy; at exit otherwise)."""
        if self.swap is not None:
            self.swap.close()

    def parameters_without_gradient(self) -> list[str]:
        """Names of trainable parameters that got no gradient in the current accumulation window."""
        return [self.groups[g].names[i] for pid, (g, i) in enumerate(self._where) if not self._got_grad[pid]]

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
        self._written = [False] * len(self._params)
        self._got_grad = [False] * len(self._params)
        self._reset_window()


def _true_numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also when zero.Init left only this rank's shard of it."""
    info = init_shard(p)
    return info.numel if info is not None else p.numel()


def averaging(config: Any, world_size: int) -> tuple[float, float]:
    """(factor before, factor after) the gradient sum across ranks (DeepSpeed's allreduce_bucket):
    prescale_gradients divides by W before; otherwise by gradient_predivide_factor f before and by W/f
    after. gradient_allreduce_op "sum" skips the averaging."""
    f = config.gradient_predivide_factor
    if config.gradient_allreduce_op == "sum":
        return 1.0 / f, f
    if config.prescale_gradients:
        return 1.0 / world_size, 1.0
    return 1.0 / f, f / world_size
