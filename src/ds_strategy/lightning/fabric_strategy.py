"""``ZeroFabricStrategy``: Lightning Fabric drives ds_strategy's ZeRO engine.

    import ds_strategy                                         # registers "zero1" ... "zero3_offload"
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2, precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module():                                 # stage 3: built partitioned
        model = GPT(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))

Every ``fabric.setup(model, optimizer)`` builds one ``ZeroEngine``; several engines live side by side in
one process (a GAN's generator and discriminator, a student and its frozen teacher) and each trains on
its own. What Fabric calls on the strategy, and where it goes:

- ``fabric.backward(loss, model=...)``: the engine's backward (loss scaling, gradient hooks). With one
  trainable engine ``model=`` may be left out.
- ``optimizer.step()`` / ``optimizer.zero_grad()``: the engine's ``step()`` / ``zero_grad()``
  (``EngineOptimizer``).
- ``fabric.no_backward_sync(model)``: the backward is not an accumulation boundary (stages 0-1 keep the
  gradients local; stage 2-3 reduce-scatter as always); the loss is the user's to divide, as under DDP.
- ``fabric.clip_gradients(model, optimizer, max_norm=...)``: returns the global gradient norm now and
  clips the next ``optimizer.step()`` by it (the engine clips inside its step, across partitions).
- ``fabric.save`` / ``fabric.load``: a directory per model (fabric_checkpoint.py).
- ``fabric.init_module()``: at stage 3 ``zero.Init`` (each rank materialises its shard only).

What both faces do alike (config, launcher, precision plugin, stage-3 init context, engine build) is
their ``ZeroCore`` (core.py); the process layout is process.py's, one engine's checkpoint checkpoint.py's.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from ds_strategy.config import OnConflict
from ds_strategy.runtime.activation_checkpointing import Policy

from . import fabric_checkpoint
from ._compat import (
    _PATH,
    _BackwardSyncControl,
    _FabricMultiProcessingLauncher,
    _FabricSubprocessScriptLauncher,
    _Sharded,
)
from .compile import CompileArg
from .config import ConfigArg, StartMethod
from .core import ZeroCore, ZeroFace, clipping_at
from .fabric_optimizer import EngineOptimizer
from .fabric_precision import ZeroFabricPrecision
from .process import ProcessLayout

if TYPE_CHECKING:
    from ds_strategy.runtime import ZeroEngine


class ZeroFabricStrategy(ZeroFace, ProcessLayout, ParallelStrategy, _Sharded):
    """ZeRO data parallelism (stages 0-3, CPU/NVMe offload, fp16/bf16) for Lightning Fabric.

    The keywords are ``ZeroStrategy``'s (docs/lightning.md), ``activation_checkpointing_policy`` included
    (applied to each model at ``fabric.setup``); ``config`` is a DeepSpeed config (dict or JSON path).
    The micro batch size is the config's ``train_micro_batch_size_per_gpu``, else ``micro_batch_size``,
    else 1 (bookkeeping only: Fabric hands the engine no dataloader). Gradient clipping is the config's
    ``gradient_clipping`` or ``fabric.clip_gradients(..., max_norm=...)``. ``compile`` (True or the
    ``compile`` block's keys) compiles each model inside its engine at ``fabric.setup`` (docs/compile.md).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Literal[0, 1, 2, 3] | None = None,
        *,
        offload_optimizer: bool | None = None,
        offload_parameters: bool | None = None,
        offload_optimizer_device: Literal["cpu", "nvme"] | None = None,
        offload_params_device: Literal["cpu", "nvme"] | None = None,
        nvme_path: str | None = None,
        config: ConfigArg = None,
        reduce_bucket_size: int | None = None,
        allgather_bucket_size: int | None = None,
        loss_scale: float | None = None,
        initial_scale_power: int | None = None,
        micro_batch_size: int | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "auto",
        activation_checkpointing_policy: Policy | None = None,
        on_conflict: OnConflict = "error",
        exclude_frozen_parameters: bool = False,
        compile: CompileArg = None,
        sequence_parallel_size: int | None = None,
    ) -> None:
        self.core = ZeroCore.of("ZeroFabricStrategy", locals())
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        if self.raw_config.get("optimizer") is not None:
            raise ValueError(
                'ZeroFabricStrategy: the DeepSpeed config has an "optimizer" block, but Fabric hands the optimizer '
                "to fabric.setup(model, optimizer); remove the block and build the optimizer in your code"
            )
        self.layout_process_group(process_group_backend, timeout)
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.engines: list[ZeroEngine] = []
        self._clip_next_step: dict[int, float] = {}  # id(engine) -> max_norm of fabric.clip_gradients
        self._backward_sync_control = _EngineNoSync()

    # ------------------------------------------------------------------ what Fabric asks of a strategy
    @property
    @override
    def precision(self) -> ZeroFabricPrecision:
        return ZeroFabricPrecision.current(self._precision)

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        self._precision = ZeroFabricPrecision.adopt(precision)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self.core.launcher(self, _FabricSubprocessScriptLauncher, _FabricMultiProcessingLauncher)

    # ------------------------------------------------------------------ process group
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.start_process_group()

    # ------------------------------------------------------------------ building models
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: at stage 3 the model is built partitioned (``zero.Init``), each rank
        materialising only its shard; below stage 3, on the device in the precision's dtype."""
        if self.stage != 3:
            return super().module_init_context(empty_init=empty_init)
        stack = ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(self.module_sharded_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        if self.stage != 3:
            return ExitStack()
        if not torch.distributed.is_initialized():
            raise RuntimeError(
                "ZeroFabricStrategy: fabric.init_module() at ZeRO stage 3 partitions the model across the "
                "processes, which must exist first: call fabric.launch() before it"
            )
        return self.core.sharded_init()

    @override
    def module_to_device(self, module: Module) -> None:
        if self.stage < 3:
            module.to(self.root_device)
        # stage 3: the engine places each rank's partition itself (a partitioned parameter is not moved)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """One engine for ``module`` and its one optimizer (``fabric.setup(model, optimizer)``)."""
        if len(optimizers) != 1:
            raise ValueError(
                f"ZeroFabricStrategy builds one ZeRO engine per fabric.setup call, with one optimizer; got "
                f"{len(optimizers)}. Use one optimizer with a param group per parameter set, or set up each model "
                "with its own optimizer (GAN-style: fabric.setup(generator, opt_g), fabric.setup(discriminator, opt_d))"
            )
        engine = self._new_engine(module, optimizers[0])
        return engine, [EngineOptimizer(engine)], scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        """An engine without an optimizer (``fabric.setup(model)``): evaluation, or a frozen teacher; at stage
        3 its parameters stay partitioned and are gathered for each forward."""
        return self._new_engine(module, None)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise RuntimeError(
            "ZeroFabricStrategy builds the model's ZeRO engine together with its optimizer, so "
            "fabric.setup_optimizers() after fabric.setup_module() cannot work: create the optimizer first and "
            "call model, optimizer = fabric.setup(model, optimizer) (under fabric.init_module() at stage 3 the "
            "parameters the optimizer references are already partitioned)"
        )

    def _new_engine(self, module: Module, optimizer: Optimizer | None) -> ZeroEngine:
        if not torch.distributed.is_initialized():
            raise RuntimeError("ZeroFabricStrategy: call fabric.launch() before fabric.setup()")
        config = self.core.resolve(
            world_size=self.world_size,
            precision=self.precision.precision,
            micro_batch_size=self.core.micro_batch_size(),  # Fabric hands the engine no dataloader
            accumulate_grad_batches=1,
            gradient_clip_val=None,
        )
        engine = self.core.build_engine(module, config, optimizer, self.root_device)
        self.engines.append(engine)
        return engine

    # ------------------------------------------------------------------ backward, step, clipping
    def engine_of(self, module: Module | None) -> ZeroEngine:
        """The engine a backward runs through: the given set-up model's, or the one trainable engine."""
        from ds_strategy.runtime import ZeroEngine

        if isinstance(module, ZeroEngine):
            return module
        if module is not None:
            raise TypeError(
                f"ZeroFabricStrategy: {type(module).__name__} is not a model set up by fabric.setup (a ZeRO engine)"
            )
        trainable = [e for e in self.engines if e.optimizer is not None]
        if len(trainable) == 1:
            return trainable[0]
        if not trainable:
            raise RuntimeError(
                "ZeroFabricStrategy: no model was set up with an optimizer; call "
                "model, optimizer = fabric.setup(model, optimizer) before fabric.backward"
            )
        raise ValueError(
            f"ZeroFabricStrategy: {len(trainable)} models are set up with optimizers; name the one this loss "
            "trains: fabric.backward(loss, model=model)"
        )

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"ZeroFabricStrategy backward takes no extra positional arguments, got {len(args)}")
        retain_graph = bool(kwargs.pop("retain_graph", False))
        if kwargs:
            raise TypeError(f"ZeroFabricStrategy backward does not accept {', '.join(kwargs)}")
        self.engine_of(module).backward(tensor, retain_graph=retain_graph)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"optimizer.step() under ZeroFabricStrategy takes no arguments, got {', '.join(kwargs)}")
        if not isinstance(optimizer, EngineOptimizer):
            raise TypeError(
                f"ZeroFabricStrategy steps the optimizers fabric.setup returned, not {type(optimizer).__name__}"
            )
        engine = optimizer.engine
        max_norm = self._clip_next_step.pop(id(engine), None)
        with clipping_at(engine, max_norm):
            engine.step()

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global L2 norm of the averaged gradients (all partitions); the next ``optimizer.step()`` of this
        model scales them to at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` would now."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"ZeroFabricStrategy clips by the global L2 norm only; got norm_type={norm_type}. Use norm_type=2"
            )
        engine = self.engine_of(module)
        norm = engine.current_grad_norm()
        fp16_overflow = norm == float("inf") and engine.compute_dtype == torch.float16
        if error_if_nonfinite and not fp16_overflow and not torch.isfinite(torch.tensor(norm)):
            raise RuntimeError(
                f"the total norm of the gradients is non-finite ({norm}), so they cannot be clipped; pass "
                "error_if_nonfinite=False to fabric.clip_gradients to clip anyway"
            )
        self._clip_next_step[id(engine)] = float(max_norm)
        return torch.tensor(norm)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        raise NotImplementedError(
            "ZeroFabricStrategy clips gradients by their global norm only (across all partitions); use "
            "fabric.clip_gradients(model, optimizer, max_norm=...) instead of clip_val"
        )

    # ------------------------------------------------------------------ collectives
    def live_engines(self) -> list[ZeroEngine]:
        return list(self.engines)

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return self.reduce_tensor(tensor, group, reduce_op)

    # ------------------------------------------------------------------ checkpoints (fabric_checkpoint.py)
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "ZeroFabricStrategy.save_checkpoint(storage_options=...) is not supported: every engine writes its "
                "sharded checkpoint itself, not through a CheckpointIO plugin"
            )
        if filter is not None:
            raise TypeError(
                "fabric.save(..., filter=...) is not supported by ZeroFabricStrategy: the engines save their "
                "partitions whole; to leave frozen parameters out use "
                "ZeroFabricStrategy(exclude_frozen_parameters=True)"
            )
        path = self.broadcast(path)  # one directory for every rank, whatever each rank computed
        fabric_checkpoint.save(
            path, state, is_global_zero=self.is_global_zero, exclude_frozen_parameters=self.exclude_frozen_parameters
        )
        self.barrier()  # rank 0's fabric_state.pt is there before any rank reads it back

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = self.broadcast(path)
        return fabric_checkpoint.load(path, state, strict=strict)

    # ------------------------------------------------------------------ end
    @override
    def teardown(self) -> None:
        """Every engine hands its parameters back to its module (stage 3: each rank its shard, as
        ``zero.Init`` leaves them) and releases its hooks; a collective, so every rank calls it."""
        for engine in self.engines:
            engine.destroy()
        self.engines = []
        self._clip_next_step = {}
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # registered by ds_strategy.lightning.registry under its own names


class _EngineNoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the backward inside is not an accumulation boundary."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _not_a_boundary(module) if enabled else ExitStack()


@contextmanager
def _not_a_boundary(module: Module) -> Generator[None, None, None]:
    from ds_strategy.runtime import ZeroEngine

    if not isinstance(module, ZeroEngine):
        raise TypeError(
            f"fabric.no_backward_sync: {type(module).__name__} is not a model set up under ZeroFabricStrategy"
        )
    module.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        module.set_gradient_accumulation_boundary(None)
