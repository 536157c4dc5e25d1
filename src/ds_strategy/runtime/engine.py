"""``ZeroEngine``: DeepSpeed's training-engine API over the ZeRO stages of ``runtime.zero``.

    loss = engine(batch)      # forward (bf16, fp16 with auto_cast: floating inputs cast to the compute dtype)
    engine.backward(loss)     # loss x loss_scale / gradient_accumulation_steps, gradient hooks reduce
    engine.step()             # at the accumulation boundary: norm, overflow, clip, optimizer, gather

One engine serves the Lightning strategy and plain PyTorch loops. It never branches on the stage number
beyond choosing the stage class; precision is decided once (``Precision``), the loss scale by
``LossScaler``.

[Note: no host synchronisation in a step]
A step never waits for the device (docs/zero3.md, "No host synchronisation in a step"): the gradient norm
and the inf/nan flag are device tensors, the clipping coefficient ``clamp(clip / (norm + 1e-6), max=1)``
too, and the stage skips a non-finite step on the device (see [Note: the step on the device] in
zero/step.py). What the host used to read becomes lazy: ``get_global_grad_norm()``, ``was_step_applied()``
and ``skipped_steps`` read the device when asked. The one read a step keeps is fp16's: the dynamic loss
scale and the skipped step (lr scheduler not advanced, loss scale halved, the log line) must be known on
the host, so ``_take_model_step`` reads ``[norm, overflow]`` once per optimizer step. Under the
device-strict mode the engine brackets forward, backward, step and zero_grad with
``strict.no_host_reads`` from its second optimizer step on, with that read (and the offloaded optimizer's,
whose data lives on the host) allowed by name.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ds_strategy.accelerator import get_accelerator, strict
from ds_strategy.comm import CommsLogger
from ds_strategy.config import DeepSpeedConfig, load_config
from ds_strategy.log import get_logger
from ds_strategy.runtime import activation_checkpointing
from ds_strategy.runtime.activation_checkpointing import ModelParallelUnit
from ds_strategy.sequence.groups import SequenceGroups, set_active

from .compile import Backend, CompiledForwards, check_backend, check_kwargs, compile_regions, mark_leaves
from .counters import StepCounters
from .hybrid import GenerateFn, HybridEngine
from .inference_tp import build_tensor_parallel
from .moe.engine_moe import EngineMoE
from .moe.full import full_state_dict as moe_full_state_dict
from .muon import embedding_ids, split_for_muon
from .packed import is_packed
from .params import (
    OptimizerArg,
    ParamsArg,
    attach_optimizer,
    check_client_optimizer,
    named_trainable_groups,
    param_groups,
    wants_whole_params,
)
from .precision import Precision, make_loss_scaler
from .profiling import EngineProfiling
from .timers import Throughput, Timers
from .zero import STAGES, Collectives
from .zero.access import FullStateAccess
from .zero.divergence import diverged_in_backward
from .zero.grad_norm import grad_norm
from .zero.leaf import apply_leaf_module_config
from .zero.offload import Offload
from .zero.per_tensor import check_whole_params, optimizer_params

log = get_logger("ds_strategy.runtime")

SchedulerArg = Any  # an object with step() (torch LRScheduler or ours), or a callable(optimizer) -> that


class ZeroEngine(nn.Module):
    """Wraps ``module`` for ZeRO data-parallel training (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        config: DeepSpeedConfig,
        *,
        optimizer: OptimizerArg = None,
        model_parameters: ParamsArg = None,
        lr_scheduler: SchedulerArg = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        mpu: ModelParallelUnit | None = None,
    ) -> None:
        super().__init__()
        self.comms_logger = CommsLogger.from_config(config.comms_logger)
        self.coll = Collectives(process_group, logger=self.comms_logger)
        if config.world_size is None or config.world_size * config.sequence_parallel_size != self.coll.world_size:
            config = load_config(config, world_size=self.coll.world_size)
        # Ulysses: ZeRO partitions and reduces over every rank of the group (DeepSpeed's sequence-data-parallel
        # group); the sequence-parallel groups trade sequence for heads around attention (ds_strategy.sequence).
        self.sequence: SequenceGroups | None = None
        if config.sequence_parallel_size > 1:
            self.sequence = SequenceGroups.build(config.sequence_parallel_size, process_group, worker_from=self.coll)
            set_active(self.sequence)
        self.config = config
        self.batch = config.batch  # raises a ConfigError naming what is missing
        if config.input_config is not None and "activation_checkpointing" in config.input_config:
            activation_checkpointing.configure(mpu, deepspeed_config=config)  # ds_strategy.checkpointing acts on it
        self.precision = Precision.from_config(config)
        self.module = module
        stage_cls = STAGES.get(config.zero_stage)
        if stage_cls is None:
            raise ValueError(f"ZeRO stage {config.zero_stage} is not implemented by this engine (stages 0-3)")
        self.offload = Offload.from_config(config.zero_optimization, config.aio)
        apply_leaf_module_config(module, config.zero_optimization.leaf_module)  # before stage 3 lays out buckets
        self.compiled = CompiledForwards()
        if config.compile.enabled:  # a bad backend fails before anything is built
            check_backend(config.compile.backend)
            check_kwargs(config.compile.kwargs)
            if stage_cls.places_its_parameters:  # compiled blocks become leaves: each block's buckets together
                mark_leaves(compile_regions(module, per_block=True))
        if isinstance(optimizer, Optimizer):  # fail before the parameters are moved into flat buffers
            check_client_optimizer(optimizer, stage=config.zero_stage, offload=self.offload.optimizer, config=config)
        groups = param_groups(module, optimizer, model_parameters)
        # The client's groups by parameter name, in its order: how a torch optimizer's state_dict() numbers
        # them (load_full_optimizer_state).
        names = {p: n for n, p in module.named_parameters()}
        self._client_param_names = [[names.get(p) for p in g["params"]] for g in groups]
        # A per-tensor optimizer steps whole parameters: [Note: per-tensor optimizers under ZeRO].
        whole = wants_whole_params(optimizer, config)
        if whole and optimizer is None and config.optimizer is not None and config.optimizer.type == "Muon":
            groups = split_for_muon(groups, embedding_ids(module))  # Muon's matrices, AdamW's rest
        # MoE layers: expert groups built once per ep_size; expert param groups reduce over them.
        self.moe = EngineMoE.create(
            module,
            stage=config.zero_stage,
            nvme=self.offload.optimizer_nvme is not None or self.offload.params_nvme is not None,
            process_group=process_group,
            logger=self.comms_logger,
            coll=self.coll,
        )
        if self.moe is not None:
            if config.sequence_parallel_size > 1:
                raise ValueError(
                    f"sequence_parallel_size={config.sequence_parallel_size} with ds_strategy.moe.MoE layers: "
                    "expert parallelism beside Ulysses sequence parallelism is not built; train the MoE model "
                    "with sequence_parallel_size 1, or a dense model with sequence parallelism"
                )
            groups = self.moe.split(groups, optimizer)
        named, registration = named_trainable_groups(module, groups)
        trainable = {id(p) for group in named for _, p in group}
        partitioned = (  # stage 3 partitions the trainable and the frozen floating parameters
            [p for p in module.parameters() if id(p) in trainable or (not p.requires_grad and p.is_floating_point())]
            if stage_cls.places_its_parameters
            else []
        )
        self.device = _place(module, device, keep=partitioned)
        options = stage_cls.options_from(
            config, precision=self.precision, device=self.device, world_size=self.coll.world_size, offload=self.offload
        )
        if self.moe is not None:
            options = dataclasses.replace(options, group_comms=self.moe.group_comms(groups))
        if whole:
            name = type(optimizer).__name__ if isinstance(optimizer, Optimizer) else "this optimizer"
            check_whole_params(self.offload, moe=self.moe is not None, what=name)
            # MuonWithAuxAdam's AdamW groups (use_muon false) are element-wise: flat, no padding
            flags = tuple(bool(g.get("use_muon", True)) for g in groups)
            options = dataclasses.replace(options, whole_params=flags)
        self.stage = stage_cls.create(
            named, registration, coll=self.coll, options=options, module=module, config=config
        )
        self._cast_and_sync_the_rest(registration)
        self.optimizer: Optimizer | None = attach_optimizer(
            optimizer,
            groups,
            optimizer_params(self.stage.groups, self.stage.whole),
            config,
            master_device=self.offload.master_device(self.device),
            offload=self.offload.optimizer,
            whole=whole,
        )
        if self.stage.swapper is not None:
            self.stage.swapper.optimizer = self.optimizer  # its state is swapped with the masters
        self.lr_scheduler = self._scheduler(lr_scheduler)
        self.loss_scaler = make_loss_scaler(config)
        self.stage.attach()
        # safe_get_* / safe_set_* (ds_strategy.utils) find the engine through each trainable parameter.
        self.state_access = FullStateAccess(self)
        self.state_access.attach()
        # What the partitions were built from: a later change cannot be followed (see _refuse_changed_params).
        self._requires_grad_at_build = [(n, p, p.requires_grad) for n, p in module.named_parameters()]
        self._optimizer_groups_at_build = len(self.optimizer.param_groups) if self.optimizer is not None else 0

        self.counters = StepCounters()
        self.training_dataloader: Any = None
        self._step_applied: bool | torch.Tensor = False  # a device flag "skipped" until read (see the note)
        self._global_grad_norm: float | torch.Tensor | None = None  # a device tensor until read
        self._boundary_override: bool | None = None
        # The step's (norm, overflow) source: the stage's by default (device tensors); the PipelineEngine
        # widens it to every stage (host numbers).
        self.grad_norm_fn: Callable[[], tuple[Any, Any]] | None = None
        self._no_sync = False
        self._loss_sum: torch.Tensor | None = None
        self.last_loss: torch.Tensor | None = None
        self.timers = Timers(config.wall_clock_breakdown, self.device)
        self._throughput = Throughput()
        self._print_every = config.steps_per_print or (10 if config.wall_clock_breakdown else None)
        self.profiling = EngineProfiling(
            weakref.proxy(self),  # the profiler reads world size and timers from it; no cycle back to us
            module,
            config.flops_profiler,
            rank=self.coll.rank,
            world_size=self.coll.world_size,
            micro_batch_size=self.batch.train_micro_batch_size_per_gpu,
            device=self.device,
            dtype=self.precision.compute_dtype,
            sequence_shards=config.sequence_parallel_size,
        )
        self.flops_profiler = self.profiling.profiler  # DeepSpeed's attribute: None unless flops_profiler.enabled
        self.hybrid = HybridEngine(
            self.stage,
            config.hybrid_engine,
            max_live_numel=int(config.zero_optimization.stage3_max_live_parameters),
            rank=self.coll.rank,
            report=config.wall_clock_breakdown,
            tensor_parallel=build_tensor_parallel(
                module,
                size=config.hybrid_engine.inference_tp_size if config.hybrid_engine.enabled else 1,
                coll=self.coll,
            ),
        )
        if config.compile.enabled:
            self.compile(backend=config.compile.backend, compile_kwargs=dict(config.compile.kwargs))

    # ------------------------------------------------------------------ set-up helpers
    @torch.no_grad()
    def _cast_and_sync_the_rest(self, registration: dict[nn.Parameter, int]) -> None:
        """Frozen parameters and floating buffers: cast to the compute dtype, then rank 0's values win."""
        flat_owned = {id(p) for p in self.stage.placement.stored_params()}
        dtype = self.precision.compute_dtype
        for p in registration:
            if id(p) not in flat_owned:
                if p.is_floating_point() and p.dtype != dtype and not is_packed(p):  # [Note: packed parameters]
                    p.data = p.data.to(dtype)
                expert_comm = self.moe.comm_for(p) if self.moe is not None else None
                (expert_comm or self.coll).broadcast(p.data)  # a frozen expert: within its replicas
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is None:
                    continue
                if buf.is_floating_point() and buf.dtype != dtype:
                    mod._buffers[name] = buf = buf.to(dtype)
                expert_comm = self.moe.comm_for_module(mod) if self.moe is not None else None
                (expert_comm or self.coll).broadcast(buf)  # an expert's buffer: within its replicas

    def _scheduler(self, lr_scheduler: SchedulerArg) -> Any:
        if lr_scheduler is not None:
            return (
                lr_scheduler(self.optimizer)
                if callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
                else lr_scheduler
            )
        if self.config.scheduler is not None and self.optimizer is not None:
            from .lr_schedules import build_scheduler

            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    # ------------------------------------------------------------------ DeepSpeed's engine API
    def _no_host_reads(self, what: str) -> Any:
        """The device-strict mode's bracket around a step's work from the second optimizer step on (see [Note:
        no host synchronisation in a step]); nothing at all without the mode."""
        if not strict.ACTIVE or self.counters.global_steps < 1:
            return strict.NOTHING
        return strict.no_host_reads(what)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        activation_checkpointing.reset()  # contiguous checkpoint buffers are reused from the first again
        with (
            self._no_host_reads("ZeroEngine.forward"),
            self.timers("forward"),
            self.stage.placement.forward_context(),
            self.profiling.forward(self.global_steps, inputs, kwargs),
        ):
            args, kwargs = self.precision.cast_forward_inputs(inputs, kwargs)
            return self.module(*args, **kwargs)

    def generate(self, *args: Any, generate_fn: GenerateFn | None = None, **kwargs: Any) -> Any:
        """``module.generate(*args, **kwargs)``, or ``generate_fn(*args, **kwargs)``; with
        ``hybrid_engine.enabled`` stage 3 gathers the parameters once for the call (docs/hybrid_engine.md)."""
        with self.compiled.eager():  # decoding would compile a graph per sequence length: see runtime/compile.py
            return self.hybrid.generate(self.module, generate_fn, args, kwargs)

    def compile(  # DeepSpeed's signature, not nn.Module.compile's
        self, backend: Backend | None = None, compile_kwargs: dict[str, Any] | None = None
    ) -> None:
        """torch.compile the module inside the engine (DeepSpeed's ``engine.compile``): stages 0-2 its
        forward, stage 3 each repeated block's forward with the gathers eagerly at the block boundaries
        (see runtime/compile.py). ``backend`` defaults to ``compile.backend``; ``compile_kwargs`` go to
        torch.compile. A second call does nothing."""
        if self.compiled.is_compiled:
            return
        backend = self.config.compile.backend if backend is None else backend
        stage3 = self.config.zero_stage == 3
        regions = compile_regions(self.module, per_block=stage3)
        self.compiled.compile(regions, backend, compile_kwargs or {}, leaves=stage3)
        self.stage.placement.unhook_inside(regions)

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile()`` (or ``compile.enabled``) compiled the module."""
        return self.compiled.is_compiled

    def train(self, mode: bool = True) -> ZeroEngine:
        """Set the module's training mode (``eval()`` is ``train(False)``), as DeepSpeed's engine; with the
        hybrid engine enabled, ``eval()`` logs the time of the last generate/train cycle on rank 0."""
        if "hybrid" in self.__dict__:  # nn.Module.__init__ may call it before the engine is built
            self.hybrid.mode_changed(mode)
        return super().train(mode)

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` x loss scale (/ gradient_accumulation_steps); reduces at the boundary."""
        with self._no_host_reads("ZeroEngine.backward"):
            return self._backward(loss, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> torch.Tensor:
        gas = self.batch.gradient_accumulation_steps
        factor = self.loss_scaler.loss_scale / (gas if scale_wrt_gas else 1)
        # last_loss is the window's mean micro-batch loss: a caller that already divided by the number of
        # micro-batches (scale_wrt_gas=False, as Lightning does) hands in its share of that mean.
        detached = loss.detach().float() / (gas if scale_wrt_gas else 1)
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        scaled = loss.float() * factor if factor != 1.0 else loss
        boundary = self.is_gradient_accumulation_boundary() and not self._no_sync
        with self.timers("backward"):
            self.stage.begin_backward(reduce=boundary)
            try:
                scaled.backward(retain_graph=retain_graph)
                self.stage.end_backward()
            except BaseException as err:
                # Local clean-up only: the error may be a peer's failure or a divergence, and a collective
                # now (the pass's remaining reductions) would wait for ranks that are gone.
                self.stage.end_backward(failed=True)
                named = diverged_in_backward(err, self.dp_rank)
                if named is not err:
                    raise named from err
                raise
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Call after every ``backward``; the optimizer steps only at the accumulation boundary."""
        if self.is_gradient_accumulation_boundary():
            with self._no_host_reads("ZeroEngine.step"), self.timers("step"):
                self._take_model_step(lr_kwargs or {})
        else:
            self._step_applied = False  # DeepSpeed's: no optimizer step was applied by this call
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict[str, Any]) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                'engine.step() needs an optimizer: pass optimizer=... or add an "optimizer" block to the config'
            )
        self._refuse_changed_params()
        self.hybrid.release()  # a pinned gathered copy would go stale when the partitions are updated
        self.stage.reducer.catch_up()
        if not self.config.zero_optimization.ignore_unused_parameters:
            self._refuse_unused_parameters()
        raw_norm, overflow = (self.grad_norm_fn or partial(grad_norm, self.stage))()
        scale = self.loss_scaler.loss_scale
        multiplier = self.stage.options.post_scale / scale
        clip = self.config.gradient_clipping
        skipped: bool | None
        if self.config.fp16_enabled or not isinstance(overflow, torch.Tensor):
            # fp16: the one host read of a step (see [Note: no host synchronisation in a step]). The pipeline
            # engine's norm comes as host numbers already.
            with strict.host_read_allowed(FP16_READ):
                raw, over = _host_numbers(raw_norm, overflow)
            norm = raw * multiplier
            self._global_grad_norm = norm
            skipped = over
            if not over:
                coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
                self.stage.stepper.apply(self.optimizer, multiplier * coef)
        else:  # on the device: norm, clipping coefficient and the skip stay tensors
            norm_t = raw_norm.double() * multiplier
            self._global_grad_norm = norm_t
            coef_t = torch.clamp(clip / (norm_t + 1e-6), max=1.0) if clip > 0 else None
            skipped = self.stage.stepper.apply(self.optimizer, multiplier, clip=coef_t, skip=overflow)
        self.stage.zero_grad()
        if skipped is None:  # known on the device only: the counters and was_step_applied read it when asked
            self.counters.add_device_skip(overflow)
            self._step_applied = overflow
            self.loss_scaler.update(False)  # no loss scaler outside fp16: this only counts
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        elif skipped:
            self.loss_scaler.update(True)
            self.skipped_steps += 1
            self._step_applied = False
            if self.coll.rank == 0:
                log.info(
                    "step %d: inf/nan in the gradients, step skipped; loss scale %g -> %g",
                    self.global_steps + 1,
                    scale,
                    self.loss_scaler.loss_scale,
                )
        else:
            self.loss_scaler.update(False)
            self._step_applied = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        self.global_steps += 1
        self.global_samples += self.batch.train_batch_size
        self.profiling.step_done(self.global_steps - 1, self.global_samples)
        if self._loss_sum is not None:
            self.last_loss = self._loss_sum
            self._loss_sum = None
        if self._print_every and self.global_steps % self._print_every == 0:
            with strict.host_read_allowed("steps_per_print: the report line reads the loss and the norm"):
                self._report()

    def _refuse_changed_params(self) -> None:
        """The flat buffers, partitions and optimizer state were laid out for the parameters that were
        trainable when the engine was built: a later requires_grad flip (Lightning's BackboneFinetuning) or
        optimizer.add_param_group would be silently untrained or stepped unreduced, so it raises instead."""
        flipped = [(n, was) for n, p, was in self._requires_grad_at_build if p.requires_grad != was]
        added = self.optimizer is not None and len(self.optimizer.param_groups) != self._optimizer_groups_at_build
        if not flipped and not added:
            return
        what = "; ".join(f"{n!r} became {'frozen' if was else 'trainable'}" for n, was in flipped[:5]) + (
            f" (and {len(flipped) - 5} more)" if len(flipped) > 5 else ""
        )
        if added:
            what = (what + "; " if what else "") + "optimizer.add_param_group() added a param group"
        raise RuntimeError(
            f"parameters changed after the ZeRO engine was built: {what}. ZeRO lays out its flat buffers, "
            "partitions and optimizer state once, from the parameters trainable at initialize(); set "
            "requires_grad (and the optimizer's param groups) before building the engine - to unfreeze in "
            "phases, keep every parameter trainable with a zero learning rate in its param group until its "
            "phase starts - or build a new engine for the next phase"
        )

    def _refuse_unused_parameters(self) -> None:
        """``ignore_unused_parameters: false``: every rank raises when any rank has a trainable parameter
        that got no gradient in this window (DeepSpeed asserts; here the ranks agree first, so none hangs)."""
        missing = self.stage.intake.parameters_without_gradient()
        # On the compute device (an empty first param group's device is the host, which NCCL refuses).
        count = torch.tensor([float(len(missing))], device=self.stage.compute_device)
        self.coll.all_reduce(count)
        with strict.host_read_allowed("ignore_unused_parameters: false agrees on the host every step"):
            if count.item() == 0:
                return
        where = ", ".join(repr(n) for n in missing) if missing else "parameters of another rank"
        raise RuntimeError(
            f"zero_optimization.ignore_unused_parameters is false and {int(count.item())} trainable parameter(s) "
            f"got no gradient in this step's accumulation window: {where}. Make every trainable parameter take "
            "part in the loss, freeze the unused ones (requires_grad=False), or set ignore_unused_parameters to "
            "true (DeepSpeed's default)"
        )

    def _report(self) -> None:
        rate = self._throughput.rate(self.global_samples)
        breakdown = self.timers.mean_ms()
        extra = self.profiling.report(self.global_samples)
        if self.coll.rank != 0:
            return
        loss = float(self.last_loss) if self.last_loss is not None else float("nan")
        lrs = ", ".join(f"{lr:.4g}" for lr in self.get_lr())
        log.info(
            "step=%d skipped=%d lr=[%s] loss=%.5g grad_norm=%.4g loss_scale=%g samples/sec=%.2f%s",
            self.global_steps,
            self.skipped_steps,
            lrs,
            loss,
            self.get_global_grad_norm() or 0.0,
            self.loss_scaler.loss_scale,
            rate,
            extra,
        )
        if breakdown:
            log.info("time (ms) | %s", " | ".join(f"{k}: {v:.2f}" for k, v in breakdown.items()))

    @property
    def throughput(self) -> dict[str, float]:
        """The last optimizer step's samples_per_sec, tokens_per_sec, tflops and mfu (those known)."""
        return dict(self.profiling.latest)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the accumulation boundary until set again, as DeepSpeed's (Lightning decides it this way);
        None restores counting by ``gradient_accumulation_steps``."""
        self._boundary_override = is_boundary

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally without reducing (stages 0 and 1)."""
        if self.stage.reduces_every_backward:
            raise RuntimeError(
                f"no_sync() is not available with ZeRO stage {self.stage.stage}: gradients are "
                "partitioned across ranks while backward runs"
            )
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last optimizer step (``set_to_none`` is moot:
        the engine's gradients live in its own buffers)."""
        with self._no_host_reads("ZeroEngine.zero_grad"):
            self.stage.zero_grad()

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: its ``betas`` (Adam-like) or ``momentum`` (SGD), as DeepSpeed's."""
        if self.optimizer is None:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self.optimizer.param_groups]

    # DeepSpeed's config queries, for loops that branch on them.
    def fp16_enabled(self) -> bool:
        return self.config.fp16_enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16_enabled

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage >= 1)."""
        return self.stage.stage > 0

    def current_grad_norm(self) -> float:
        """L2 norm of the averaged, unscaled gradients of the current window, before ``step`` (what
        ``clip_grad_norm_`` returns; inf when fp16 overflowed). A collective: call on every rank. The
        window's reduction completes here, so the step that follows does not reduce again."""
        self.stage.reducer.catch_up()
        raw_norm, overflow = (self.grad_norm_fn or partial(grad_norm, self.stage))()
        raw, over = _host_numbers(raw_norm, overflow)  # asked for on the host: one read
        norm = raw * self.stage.options.post_scale / self.loss_scaler.loss_scale
        return float("inf") if over else norm

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the averaged, unscaled gradients at the last boundary (before clipping). The step keeps
        it on the device; the first call after a step reads it (one host read, only when asked)."""
        norm = self._global_grad_norm
        if isinstance(norm, torch.Tensor):
            norm = self._global_grad_norm = float(norm)
        return norm

    def step_applied_known(self) -> bool | None:
        """``was_step_applied()`` where the host knows it without reading the device (fp16, offloaded
        optimizers), None where the last step decided on the device (bf16/fp32): what a caller that must not
        synchronise (a scheduler wrapper stepping with the engine's) asks. The engine's own lr scheduler
        advances in the None case."""
        return None if isinstance(self._step_applied, torch.Tensor) else self._step_applied

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step updated the weights (False: skipped for an inf/nan gradient). A
        bf16/fp32 step decides that on the device; the first call after it reads the flag."""
        applied = self._step_applied
        if isinstance(applied, torch.Tensor):  # the skip flag
            applied = self._step_applied = not bool(applied)
        return applied

    @property
    def has_moe_layers(self) -> bool:
        """Whether the model holds ``ds_strategy.moe.MoE`` layers (DeepSpeed's attribute)."""
        return self.moe is not None

    @property
    def num_experts(self) -> list[int]:
        """``num_experts`` of each MoE layer, in registration order."""
        return [] if self.moe is None else self.moe.num_experts

    @property
    def moe_layers(self) -> list[nn.Module]:
        return [] if self.moe is None else list(self.moe.layers)

    @property
    def gate_modules(self) -> list[nn.Module]:
        return [] if self.moe is None else self.moe.gate_modules

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.stage.stage

    # DeepSpeed's counter attributes, kept in one object that checkpoints save and restore.
    @property
    def micro_steps(self) -> int:
        return self.counters.micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        self.counters.micro_steps = value

    @property
    def global_steps(self) -> int:
        return self.counters.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.counters.global_steps = value

    @property
    def global_samples(self) -> int:
        return self.counters.global_samples

    @global_samples.setter
    def global_samples(self, value: int) -> None:
        self.counters.global_samples = value

    @property
    def skipped_steps(self) -> int:
        self.counters.settle()  # steps skipped on the device are read when asked (see StepCounters)
        return self.counters.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.counters.skipped_steps = value

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def tag_validation(self) -> str:
        return str(self.config.checkpoint.tag_validation)

    @property
    def mid_accumulation(self) -> bool:
        """Micro-steps of an unfinished accumulation window were taken (their gradients are held)."""
        return self.micro_steps % self.batch.gradient_accumulation_steps != 0

    @property
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel group (the ranks of a sequence-parallel group share one)."""
        return self.coll.rank if self.sequence is None else self.sequence.dp_rank

    @property
    def dp_world_size(self) -> int:
        """The data-parallel size: ranks / ``sequence_parallel_size`` (the batch arithmetic's world size)."""
        return self.coll.world_size if self.sequence is None else self.sequence.dp_size

    @property
    def sequence_parallel_size(self) -> int:
        return 1 if self.sequence is None else self.sequence.sp_size

    @property
    def seq_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank's sequence-parallel group (None without sequence parallelism)."""
        return None if self.sequence is None else self.sequence.sp_group

    @property
    def seq_data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group ZeRO partitions and reduces over: every rank, sequence- and data-parallel (None: the world)."""
        return self.coll.group

    @property
    def seq_dp_world_size(self) -> int:
        return self.coll.world_size

    @property
    def world_size(self) -> int:
        return self.coll.world_size

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def meet_peers(self, what: str) -> None:
        """Call before a collective outside the model (``what``: "reduce", "barrier", "broadcast" or
        "all_gather"; the Lightning strategies do): at stage 3, where the ranks compare the labels of their
        parameter gathers, a peer still gathering for a forward this rank skipped and this rank both raise
        at once, naming each other, instead of waiting on different transports until a timeout. Elsewhere
        nothing (runtime/zero/divergence.py, [Note: meeting before a collective outside the model])."""
        gatherer = getattr(self.stage, "gatherer", None)
        if gatherer is not None:
            gatherer.divergence.meet(what)

    def memory_breakdown(self, *, by_device: bool = False) -> dict[str, int]:
        """Bytes this rank holds: params (flat + frozen), gathered_params (stage 3's partitioned buckets gathered
        now), grads, master (separate fp32 copies), optimizer_state. ``by_device``: each kind ``k`` cut into
        ``k`` (the compute device) and ``k_host`` (host memory: what optimizer offload, partial or full, and
        parameter offload keep there), summing to the same total (docs/memory.md)."""
        out = self.stage.memory_bytes()
        out.setdefault("gathered_params", 0)  # stage 3: gathered partitioned buckets (the hybrid engine's hold)
        flat_owned = {id(p) for p in self.stage.placement.stored_params()}
        out["params"] += sum(p.numel() * p.element_size() for p in self.module.parameters() if id(p) not in flat_owned)
        state = 0
        if self.optimizer is not None:
            for s in self.optimizer.state.values():
                state += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
        out["optimizer_state"] = state
        if by_device:
            return self._by_device(out)
        return out

    def _by_device(self, breakdown: dict[str, int]) -> dict[str, int]:
        from .zero.partial_offload import split_by_device

        stage = self.stage
        storages = getattr(stage, "storages", ())  # stage 3: the partitions (offload_param keeps them on the host)
        return split_by_device(
            breakdown,
            stage.groups,
            self.optimizer,
            offload=self.offload,
            split=stage.master_split,
            host_grad_bytes=stage.stepper.offloaded_grad_bytes(self.offload.optimizer),
            host_param_bytes=sum(gs.rest.nbytes() for gs in storages) if self.offload.params else 0,
        )

    # ------------------------------------------------------------------ checkpoints (runtime/checkpoint/)
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        exclude_optimizer_states: bool = False,
    ) -> str:
        """Write ``save_dir/<tag>`` (default ``global_step<N>``) from every rank; see docs/checkpointing.md.
        ``exclude_frozen_parameters``: leave the ``requires_grad=False`` parameters out (adapters only).
        ``exclude_optimizer_states``: weights only (no optimizer state; loading then needs
        ``load_optimizer_states=False``)."""
        from .checkpoint import save_checkpoint

        with self.stage.resident():  # NVMe offload: this rank's partitions in memory while they are written
            return str(
                save_checkpoint(
                    self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, exclude_optimizer_states
                )
            )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """Load a checkpoint saved at any world size and stage; return (tag directory, client state).
        DeepSpeed's signature: ``load_module_strict`` is accepted and the module is always loaded strictly
        (the checkpoint must be of this model: its layouts are checked); ``custom_load_fn`` must be None."""
        from .checkpoint import load_checkpoint
        from .checkpoint.load import refuse_custom_load_fn

        refuse_custom_load_fn(custom_load_fn)
        del load_module_strict  # every entry is checked against the model's layout (strict by construction)
        self.hybrid.release()
        with self.stage.resident():
            return load_checkpoint(
                self,
                load_dir,
                tag,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
            )

    def load_full_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a full (consolidated) state dict, e.g. a plain ``model.state_dict()`` or the output of
        ``ds-zero-to-fp32``, into this engine at any stage: every rank fills its own fp32 masters (and so its
        partitions) from it; buffers and frozen parameters are copied. Optimizer state is left as it is. With
        ``strict`` the keys must match the module's exactly (tied parameters may appear under either name)."""
        from .checkpoint.full import load_full_state_dict

        self.hybrid.release()
        with self.stage.resident():
            load_full_state_dict(self, state_dict, strict)

    def load_full_optimizer_state(self, state_dict: Mapping[str, Any]) -> None:
        """Load a plain torch optimizer's ``state_dict()`` (a DDP or single-process run of the same code:
        the same param groups, in the same order) into this engine's partitioned optimizer: every rank takes
        its own ranges of each parameter's moments, and the groups' hyperparameters (lr, betas ...), so the
        next step continues that run's (see [Note: importing an unpartitioned optimizer state])."""
        from .checkpoint.torch_optim import load_torch_optimizer_state

        with self.stage.resident():
            load_torch_optimizer_state(self, self._client_param_names, state_dict)

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Write the consolidated weights (compute dtype: 16-bit, or fp32 when training in fp32) as a
        state dict that the plain module loads (``load_state_dict(strict=True)``); rank 0 writes, every
        rank must call it. Stage 3 gathers the partitions only with
        ``stage3_gather_16bit_weights_on_model_save`` (like DeepSpeed: otherwise False, nothing written).
        ``exclude_frozen_parameters``: leave out every ``requires_grad=False`` parameter (a LoRA run's
        adapters only; load with ``strict=False``), as DeepSpeed's argument does."""
        zero = self.config.zero_optimization
        if self.stage.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            if self.coll.rank == 0:
                log.warning(
                    "save_16bit_model: nothing saved; set zero_optimization.stage3_gather_16bit_weights_on_model_save "
                    "to true to gather the partitioned ZeRO-3 weights into one file"
                )
            return False
        state = self.full_state_dict(rank=0)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if self.coll.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def full_state_dict(self, rank: int | None = 0) -> dict[str, torch.Tensor]:
        """The module's full state dict (compute dtype) on the CPU of ``rank`` (of every rank when None);
        the other ranks get ``{}``. Stage 3 gathers one bucket at a time, so no device ever holds the whole
        model: call it on every rank. An MoE model's experts are all there, under their global names."""
        if self.moe is not None:  # [Note: global expert names] in moe/full.py
            return moe_full_state_dict(self.module, rank=rank, own_rank=self.coll.rank)
        return self.stage.placement.full_state_dict(self.module, rank)

    def _zero3_consolidated_16bit_state_dict(self) -> dict[str, torch.Tensor]:
        """DeepSpeed's name for :meth:`full_state_dict` on rank 0."""
        return self.full_state_dict(rank=0)

    def destroy(self, *, release_params: bool = True) -> None:
        """Remove the gradient hooks and release the shared-memory segment of the collectives
        (torch.distributed's process group stays the caller's). The module keeps its parameters: stages
        0-2 their flat-buffer views, stage 3 each rank's shard as ``zero.Init`` leaves it, so a new engine
        or ``GatheredParameters`` takes the module as it is. At stage 3 that hand-back is a collective (one
        bucket at a time): call destroy on every rank, or pass ``release_params=False`` after a failure,
        when the peers may be gone (the stage-3 parameters are then left unusable)."""
        self.state_access.detach()
        self.compiled.restore()
        if release_params:
            self.hybrid.release()
            self.stage.placement.release_params()
        self.stage.detach()
        self.stage.close()  # NVMe offload: its swap files go with the engine
        if self.moe is not None:
            self.moe.close()
        if self.sequence is not None:
            self.sequence.close()  # the sequence-parallel groups it made; no longer the active layout
        self.hybrid.close()
        self.coll.close()

    def __getattr__(self, name: str) -> Any:
        # Like DeepSpeedEngine: attributes the engine lacks come from the wrapped module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise


FP16_READ = "fp16: the step's [norm, overflow], one read per optimizer step (loss scale, skipped step)"


def _host_numbers(norm: Any, overflow: Any) -> tuple[float, bool]:
    """(norm, overflow) as host numbers: one read for device tensors (a stacked pair), none for numbers."""
    if isinstance(norm, torch.Tensor) or isinstance(overflow, torch.Tensor):
        device = (norm if isinstance(norm, torch.Tensor) else overflow).device
        pair = torch.stack([torch.as_tensor(norm, dtype=torch.float64, device=device).reshape(()),
                            torch.as_tensor(overflow, dtype=torch.float64, device=device).reshape(())])  # fmt: skip
        value, over = pair.tolist()
        return value, over > 0 or not math.isfinite(value)
    return float(norm), bool(overflow) or not math.isfinite(float(norm))


def _place(
    module: nn.Module, device: torch.device | str | None = None, *, keep: Collection[nn.Parameter] = ()
) -> torch.device:
    """The device the module trains on, with the module moved there except the parameters in ``keep``.

    ``device`` (the Lightning strategy's root device, or ``initialize(device=...)``) wins; otherwise a
    module already on an accelerator stays where it is, and a CPU-built one goes to the current CUDA
    device (the one the launcher or ``init_distributed`` selected; not LOCAL_RANK, which need not be this
    rank's GPU), or to the CPU accelerator's device. ``keep``: stage 3's trainable parameters, which it
    moves bucket by bucket while partitioning, so the whole model never sits on the device.
    """
    if device is None:
        first = next(module.parameters(), None)
        if first is not None and first.device.type != "cpu":
            return first.device
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = get_accelerator("cpu").device()
    device = torch.device(device)
    if device.type == "cpu":
        device = get_accelerator("cpu").device()  # cpu:0 under the device-strict mode
    if device == torch.device("cpu"):
        return device
    if not keep:
        module.to(device)  # a move, as to a GPU (cpu:0 under the strict mode too)
        return device
    kept = {id(p) for p in keep}
    # _apply (what module.to uses) so that modules moving more than tensors (torchmetrics' states) follow.
    module._apply(lambda t: t if id(t) in kept else t.to(device))
    return device
