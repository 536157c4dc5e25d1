"""``ZeroStrategy``: Lightning drives ds_strategy's ZeRO engine.

    trainer = Trainer(strategy="zero2", accelerator="cpu", devices=2)      # after ``import ds_strategy``
    trainer = Trainer(strategy=ZeroStrategy(stage=2, config="ds_config.json"), precision="bf16-mixed")

What the strategy owns, and what it hands to whom:

- process group: Lightning's cluster environments (torchelastic, SLURM, LSF, MPI, plain) give ranks and
  the rendezvous; the strategy initialises torch.distributed from them (``setup_distributed``).
- launching: as a script, Lightning's subprocess launcher re-runs the script per rank; in an interactive
  session (Jupyter) the workers are forked from the kernel (``ZeroMultiProcessingLauncher``), and the
  full trained weights come back to the kernel's model.
- the engine: ``setup`` builds one ``ZeroEngine`` over the LightningModule with the optimizer from
  ``configure_optimizers`` (or the config's ``optimizer`` block); ``self.model`` is the engine, so
  training/validation steps run through its forward (input casting) and its gradient hooks.
- precision, loss scaling, clipping: ``ZeroPrecision`` hands backward and the optimizer step to the
  engine (see precision.py); Lightning's AMP scaler is never involved.

[Note: who decides the accumulation boundary]
Lightning decides (``handles_gradient_accumulation`` is False), exactly as for DDP: micro-batches inside
an accumulation window run their backward inside ``block_backward_sync`` (the engine is told "not a
boundary": stages 0-1 keep gradients local, stage 2 reduce-scatters as always), and the window's last
micro-batch runs through ``optimizer_step``, which tells the engine "boundary" before the closure's
backward, then calls ``engine.step()``. So a short last window of an epoch steps like DDP does. Lightning
already divides the loss by ``accumulate_grad_batches``, so the engine's backward does not divide again
(``scale_wrt_gas=False``). Manual optimization: every ``manual_backward`` accumulates without reducing and
``optimizer.step()`` reduces and steps, so several backward calls per step are fine.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.data import has_len
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ds_strategy.config import OnConflict
from ds_strategy.runtime.activation_checkpointing import Policy
from ds_strategy.runtime.checkpoint import CheckpointError

from . import checkpoint as lckpt
from . import stage3
from ._compat import (
    _PATH,
    _init_optimizers_and_lr_schedulers,
    _launch_process_observer,
    _MockOptimizer,
    _SubprocessScriptLauncher,
    train_dataloader_of,
)
from .compile import CompileArg
from .config import ConfigArg, StartMethod
from .core import ZeroCore, ZeroFace
from .launcher import ZeroMultiProcessingLauncher
from .precision import ZeroPrecision, norm_only
from .process import ProcessLayout
from .throughput import ThroughputProgress
from .uneven_eval import EndOfData
from .uneven_predict import PredictPadding

if TYPE_CHECKING:
    from ds_strategy.config import DeepSpeedConfig
    from ds_strategy.runtime import ZeroEngine

log = logging.getLogger(__name__)


class ZeroStrategy(ZeroFace, ProcessLayout, ParallelStrategy):
    """ZeRO data parallelism (stages 0-3, CPU offload, fp16/bf16) for the Lightning Trainer.

    Args:
        stage: ZeRO stage 0-3 (default: the config's ``zero_optimization.stage``, else 2).
        offload_optimizer: keep fp32 master weights and optimizer state on the CPU (stages 1-3).
        offload_parameters: keep the parameters on the CPU between uses (stage 3).
        offload_optimizer_device, offload_params_device: "cpu" or "nvme" (Lightning DeepSpeedStrategy's
            names; "nvme" keeps the offloaded state in swap files under ``nvme_path``, docs/nvme.md).
        nvme_path: the directory of the swap files of every block offloaded to NVMe.
        sequence_parallel_size: Ulysses sequence parallelism over groups of this many consecutive ranks
            (the config's ``sequence_parallel_size``): each holds 1/P of every sequence, the sampler deals
            batches per sequence-parallel group, and a batch dict with ``input_ids`` is sharded along the
            sequence before the step (``ds_strategy.sequence.shard_batch``; docs/sequence_parallel.md).
        config: a DeepSpeed config, as a dict or the path of a JSON file. Everything not covered by a
            keyword lives here; Trainer arguments fill what it leaves absent or "auto".
        reduce_bucket_size: elements per gradient-reduction bucket (``zero_optimization.reduce_bucket_size``).
        allgather_bucket_size: elements per all-gather bucket (``zero_optimization.allgather_bucket_size``).
        loss_scale: fp16 loss scale, 0 for dynamic (``fp16.loss_scale``).
        initial_scale_power: dynamic fp16 loss scale starts at 2**this (``fp16.initial_scale_power``).
        micro_batch_size: the per-rank batch size for the engine's bookkeeping (samples/s, global
            samples); default: the train dataloader's batch size.
        process_group_backend: torch.distributed backend (default: nccl on CUDA, gloo on CPU).
        timeout: collective timeout.
        start_method: "auto" forks workers in an interactive session (Jupyter) and re-runs the script
            ("popen") otherwise.
        activation_checkpointing_policy: what Lightning's FSDPStrategy takes - a set of module classes, or
            a callable deciding per module - naming the submodules whose activations are recomputed in
            backward (non-reentrant). Applied after ``configure_model`` (and zero.Init) and before the
            engine is built; parameter names do not change (docs/activation_checkpointing.md).
        on_conflict: when the config states a value the Trainer contradicts (``gradient_clipping`` vs
            ``gradient_clip_val``, ``gradient_accumulation_steps`` vs ``accumulate_grad_batches``, the
            fp16/bf16 blocks vs ``precision``): "error" (default) raises a ``ConfigError`` naming both,
            "prefer_config" / "prefer_context" keep the config's / the Trainer's value with a
            ``ConfigConflictWarning``.
        compile: torch.compile the model inside the engine (the ``compile`` config block): True (inductor),
            or a dict of the block's keys, e.g. ``{"backend": "aot_eager", "kwargs": {"dynamic": False}}``.
            Stages 0-2 compile the LightningModule's forward, stage 3 each repeated block (docs/compile.md).
        exclude_frozen_parameters: checkpoints leave out parameters with ``requires_grad=False`` (a LoRA
            run's frozen base: adapters-only checkpoints, as DeepSpeed's ``save_checkpoint`` argument).
            Loading such a checkpoint keeps the model's own frozen values (docs/finetuning.md).

    A keyword that contradicts a value stated in ``config`` raises a ``ValueError`` naming both.
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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "auto",
        activation_checkpointing_policy: Policy | None = None,
        on_conflict: OnConflict = "error",
        exclude_frozen_parameters: bool = False,
        compile: CompileArg = None,
        sequence_parallel_size: int | None = None,
    ) -> None:
        self.config = config
        self.core = ZeroCore.of("ZeroStrategy", locals())  # checks the config before anything is launched
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.layout_process_group(process_group_backend, timeout)
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self.engine: ZeroEngine | None = None
        self.engine_config: DeepSpeedConfig | None = None
        self._released = False  # stage 3 after a clean teardown: the parameters are zero.Init shards
        self._interrupted = False
        self._single_file_checkpoint = False
        self._predict_padding = PredictPadding()  # stage 3: ranks with fewer predict batches keep gathering

    # ------------------------------------------------------------------ what Lightning asks of a strategy
    @property
    def is_distributed(self) -> bool:
        """Always: ``self.log(sync_dist=True)`` reduces and the dataloaders get a DistributedSampler."""
        return True

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return False  # see [Note: who decides the accumulation boundary]

    @property
    @override
    def precision_plugin(self) -> ZeroPrecision:
        return ZeroPrecision.current(self._precision_plugin)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = ZeroPrecision.adopt(plugin)  # never Lightning's AMP around the engine

    @override
    def _configure_launcher(self) -> None:
        self._launcher = self.core.launcher(self, _SubprocessScriptLauncher, ZeroMultiProcessingLauncher)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Lightning's move, then, with sequence parallelism, this rank's slice of each sequence (core.py)."""
        return self.core.shard_batch(super().batch_to_device(batch, device, dataloader_idx))

    # ------------------------------------------------------------------ process group
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.start_process_group()

    def live_engines(self) -> list[ZeroEngine]:
        return [] if self.engine is None else [self.engine]

    # ------------------------------------------------------------------ model and engine
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()``. At stage 3 the model is built partitioned, as in ``configure_model``
        (see [Note: init_module at stage 3]); below, on the root device in the precision's dtype."""
        if self.stage != 3:
            with super().tensor_init_context(empty_init=empty_init):
                yield
            return
        if self._ranks_ready_for_init():
            with self.core.sharded_init():
                yield
            return
        rank_zero_warn(
            "Trainer.init_module() under ZeRO stage 3 in a notebook builds the whole model in the kernel (the "
            "worker processes do not exist yet); it is partitioned when fit starts. To build it partitioned, "
            "create the layers in LightningModule.configure_model() instead."
        )
        yield

    # [Note: init_module at stage 3]
    # zero.Init needs every rank in the process group. Under torchrun, SLURM, MPI or ds-launch all ranks
    # run the script already: the group is set up now instead of at fit (fit reuses it). Lightning's own
    # script launcher would start the other ranks only at fit; they are started now instead (each re-runs
    # the script and reaches this same context), and fit then finds them started (LOCAL_RANK is set). A
    # notebook's workers are forked from the kernel at fit, so nothing can be partitioned before.
    def _ranks_ready_for_init(self) -> bool:
        if torch.distributed.is_initialized():
            return True
        env = self.cluster_environment
        if env is None or isinstance(self._launcher, ZeroMultiProcessingLauncher):
            return False
        if isinstance(self._launcher, _SubprocessScriptLauncher) and not env.creates_processes_externally:
            self._launcher._call_children_scripts()
            _launch_process_observer(self._launcher.procs)
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        self.setup_distributed()
        return True

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with self.core.sharded_init():
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._released = False
        self._interrupted = False
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:  # Trainer(sync_batchnorm=True), as DDPStrategy
            _check_layer_sync(self._layer_sync, self.root_device)
            self._layer_sync.apply(module)  # converts the BatchNorm children in place
        self.model = self.precision_plugin.convert_module(module)
        if self.stage < 3:
            self.model_to_device()
        optimizer: Optimizer | None = None
        self.lr_scheduler_configs = []
        if fitting:
            _check_clipping(trainer)
            optimizer, self.lr_scheduler_configs = self._client_optimizer(module)
        self.engine_config = self._resolve_config(trainer, fitting)
        self.engine = self.core.build_engine(module, self.engine_config, optimizer, self.root_device)
        if fitting:
            if self.engine.optimizer is None:
                raise MisconfigurationException(
                    "ZeroStrategy needs an optimizer to fit: return one from configure_optimizers or add an "
                    '"optimizer" block to the DeepSpeed config'
                )
            self._adopt_config_scheduler(self.engine)
            self.optimizers = [self.engine.optimizer]
            callbacks: list[Any] = trainer.callbacks  # type: ignore[attr-defined]
            if not any(isinstance(c, ThroughputProgress) for c in callbacks):
                callbacks.append(ThroughputProgress())  # tokens/s and MFU in the progress bar
        else:
            self.optimizers = []
        self.model = self.engine
        self.setup_precision_plugin()
        self.barrier()

    def _client_optimizer(self, module: pl.LightningModule) -> tuple[Optimizer | None, list[LRSchedulerConfig]]:
        """The one optimizer (and its schedulers) from configure_optimizers; None when the config has one."""
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        real = [o for o in optimizers if not isinstance(o, _MockOptimizer)]
        in_config = self.raw_config.get("optimizer") is not None
        if in_config and real:
            raise MisconfigurationException(
                f"configure_optimizers returned {type(real[0]).__name__} and the DeepSpeed config has an "
                f'"optimizer" block ({self.raw_config["optimizer"].get("type")!r}); use one: return None from '
                'configure_optimizers, or remove the config\'s "optimizer" block'
            )
        if len(real) > 1:
            names = ", ".join(type(o).__name__ for o in real)
            raise MisconfigurationException(
                f"ZeroStrategy trains with one optimizer, but configure_optimizers returned {len(real)} ({names}). "
                "Use one optimizer with a param group per parameter set (each group can have its own lr and "
                "weight decay; note that its step moves every group, so Adam's moments and weight decay also move "
                "a group that got no gradient, unlike two torch optimizers); alternating optimizers (GAN-style) "
                "are not supported by ZeroStrategy: under Fabric, ZeroFabricStrategy builds one engine per model"
            )
        return (real[0] if real else None), schedulers

    def _adopt_config_scheduler(self, engine: ZeroEngine) -> None:
        """A scheduler from the config's "scheduler" block is stepped by Lightning (interval "step"), so
        LearningRateMonitor sees it; the engine does not step it too."""
        if engine.lr_scheduler is None:
            return
        if self.lr_scheduler_configs:
            raise MisconfigurationException(
                'the DeepSpeed config has a "scheduler" block and configure_optimizers returned a scheduler; '
                "use one of them"
            )
        scheduler = _SkipAwareScheduler(engine.lr_scheduler, engine)
        self.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval="step")]  # type: ignore[arg-type]
        engine.lr_scheduler = None

    def _resolve_config(self, trainer: pl.Trainer, fitting: bool) -> DeepSpeedConfig:
        return self.core.resolve(
            world_size=self.world_size,
            precision=self.precision_plugin.precision,
            # the train dataloader's batch size; evaluation: 1 (the engine's bookkeeping only)
            micro_batch_size=self.core.micro_batch_size(lambda: _train_batch_size(trainer) if fitting else None),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val if fitting else None,
        )

    # ------------------------------------------------------------------ predict (see uneven_predict.py)
    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.predicting and self.stage == 3 and self.world_size > 1:
            self._predict_padding.count(self.all_gather, dataloader, trainer.limit_predict_batches, self.root_device)
        evaluating = trainer is not None and (trainer.validating or trainer.testing or trainer.sanity_checking)
        if evaluating and self.stage == 3 and self.world_size > 1 and not has_len(dataloader):
            return EndOfData(dataloader, self._end_of_evaluation_data, self.global_rank)  # [Note: uneven evaluation]
        return dataloader

    def _end_of_evaluation_data(self) -> None:
        engine = self.engine
        gatherer = getattr(engine.stage, "gatherer", None) if engine is not None else None
        if gatherer is not None:
            gatherer.check_agreement()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._predict_padding.plan(self.global_rank)  # nothing counted (below stage 3, one rank): no replay

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().predict_step(*args, **kwargs)
        self._predict_padding.after_step(lambda: super(ZeroStrategy, self).predict_step(*args, **kwargs))
        return out

    # ------------------------------------------------------------------ backward and step (from ZeroPrecision)
    def require_engine(self) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError("the ZeRO engine is not set up yet: ZeroStrategy.setup() has not run")
        return self.engine

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        engine = self.engine
        if engine is None:
            yield
            return
        engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(None)

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return self.reduce_tensor(tensor, group, reduce_op)

    # ------------------------------------------------------------------ state
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's weights for Lightning's checkpoint dict, gathering nothing (see stage3.py): stages
        0-2 the full state dict; stage 3 during a run the module's own state dict (partitioned weights are
        0-element placeholders: ``save_checkpoint`` writes the engine's shards and drops this entry), after
        the run the full weights assembled now from the released shards on rank 0's CPU (other ranks: ``{}``;
        a collective: Lightning calls it on every rank)."""
        assert self.lightning_module is not None
        if self.engine is None and self._released:
            return stage3.released_weights(self.lightning_module, rank=0)
        return self.lightning_module.state_dict()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True  # teardown then issues no collective: the peers may be gone
        super().on_exception(exception)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # The engine saves the (partitioned) optimizer state itself, in save_checkpoint; Lightning's copy
        # would be dropped there, so it is not built.
        return {}

    # ------------------------------------------------------------------ checkpoints (see checkpoint.py)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads the checkpoint, so it must exist first

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it in load_checkpoint; Lightning still restores the schedulers

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Every rank writes its shard: ``filepath`` becomes a directory holding the tag ``checkpoint``
        (engine format, docs/checkpointing.md); Lightning's other state travels as the client state."""
        if storage_options is not None:
            raise TypeError(
                "Trainer.save_checkpoint(..., storage_options=...) is not supported by ZeroStrategy: the engine "
                "writes the sharded checkpoint itself, not through a CheckpointIO plugin"
            )
        filepath = self.broadcast(filepath)  # one directory for every rank, whatever each rank computed
        engine = self.engine
        if engine is None:
            # After fit the engine is released (teardown) and the module holds the full trained weights:
            # a plain single-file checkpoint from rank 0, like DDP's (no optimizer state to save).
            if os.path.isdir(filepath):  # torch.save would land inside it under a temporary name
                raise FileExistsError(
                    f"ZeroStrategy: trainer.save_checkpoint({str(filepath)!r}) after fit writes a single file, and "
                    f"{filepath} is a checkpoint directory from during fit; save to another path (or remove it first)"
                )
            rank_zero_info(
                f"ZeroStrategy: no engine (outside fit/validate/test/predict); {filepath} is written as a "
                "single-file checkpoint with the weights (no optimizer state)"
            )
            checkpoint = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath)
            return
        lckpt.save_engine(
            engine,
            filepath,
            checkpoint,
            exclude_frozen_parameters=self.exclude_frozen_parameters,
            # ModelCheckpoint(save_weights_only=True): Lightning leaves the optimizer states out of the dict.
            exclude_optimizer_states="optimizer_states" not in checkpoint,
        )

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0 deletes the checkpoint directory (or file) once every rank is past it. Call on every rank."""
        self.barrier()
        if self.is_global_zero:
            if os.path.isdir(filepath):
                shutil.rmtree(filepath)
            elif os.path.lexists(filepath):
                self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A ZeroStrategy checkpoint directory loads through the engine (weights, optimizer state, counters,
        RNG: at any world size and stage) and returns Lightning's state; a single file loads its weights only."""
        checkpoint_path = self.broadcast(checkpoint_path)
        engine = self.require_engine()
        self._single_file_checkpoint = lckpt.is_single_file(checkpoint_path)
        if self._single_file_checkpoint:
            return self._load_single_file(checkpoint_path, weights_only)
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # Lightning's schedulers are restored by Lightning from the returned state, not by the engine.
        return lckpt.load_engine(engine, checkpoint_path, load_optimizer_states=fitting, load_module_only=not fitting)

    def _load_single_file(self, path: _PATH, weights_only: bool | None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        if "state_dict" not in checkpoint:
            raise MisconfigurationException(
                f"{path} is a single file without a 'state_dict': not a Lightning checkpoint. ZeroStrategy loads "
                "the directory its save_checkpoint wrote, or a single-file Lightning checkpoint for the weights"
            )
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # Lightning insists on this key when fitting; without it the schedulers keep their fresh state.
            checkpoint.setdefault("lr_schedulers", [c.scheduler.state_dict() for c in self.lr_scheduler_configs])
            saved = checkpoint.get("optimizer_states") or []
            if not saved:
                rank_zero_warn(
                    f"ZeroStrategy: {path} is a single-file checkpoint without optimizer state (written after fit, "
                    "or by ds-zero-to-fp32 --lightning): the weights, loops, callbacks and lr schedulers are "
                    "restored, the optimizer state starts fresh. To resume exactly, resume from a directory "
                    "written by ZeroStrategy's save_checkpoint / ModelCheckpoint"
                )
            engine = self.require_engine()
            for optimizer, state in zip(self.optimizers, saved, strict=False):
                if optimizer is engine.optimizer:  # the moments too: the run continues exactly
                    try:
                        engine.load_full_optimizer_state(state)
                        continue
                    except CheckpointError as err:
                        why = str(err)
                else:
                    why = "it is not the engine's optimizer"
                rank_zero_warn(
                    f"ZeroStrategy: the optimizer state in the single-file checkpoint {path} was not loaded ({why}): "
                    "the optimizer state starts fresh. To resume exactly, resume from a directory written by "
                    "ZeroStrategy's save_checkpoint / ModelCheckpoint"
                )
                # The saved lr (and betas, weight decay) at least: a scheduler writes it only at its next
                # step, and a chainable one (StepLR) computes that step from it.
                if not lckpt.restore_hyperparameters(optimizer, state):
                    rank_zero_warn(
                        f"ZeroStrategy: {path} holds an optimizer with other param groups than this run's; the lr "
                        "and other hyperparameters start from configure_optimizers' values"
                    )
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._single_file_checkpoint:
            return  # the engine loaded the weights in load_checkpoint
        self.require_engine().load_full_state_dict(checkpoint["state_dict"], strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the engine loaded the optimizer state in load_checkpoint (single files: _load_single_file)

    @override
    def teardown(self) -> None:
        engine = self.engine
        if engine is not None:
            clean = not self._interrupted
            self._released = self.stage == 3 and clean  # the full weights: assembled when asked for
            engine.destroy(release_params=clean)
            self.engine = None
        module = self.lightning_module
        fitted = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        if fitted and module is not None and self._layer_sync is not None:
            self._layer_sync.revert(module)  # plain BatchNorm again after fit, as DDPStrategy
        self.model = module
        super().teardown()


def _check_layer_sync(layer_sync: LayerSync, device: torch.device) -> None:
    """torch's SyncBatchNorm synchronises on accelerators only: on the CPU its first training forward
    would raise; say so before anything is built."""
    if isinstance(layer_sync, TorchSyncBatchNorm) and device.type == "cpu":
        raise MisconfigurationException(
            "Trainer(sync_batchnorm=True): torch.nn.SyncBatchNorm synchronises batch statistics on GPUs only "
            "(it raises on CPU tensors, under DDP too); run on accelerator='gpu', or drop sync_batchnorm"
        )


def _check_clipping(trainer: pl.Trainer) -> None:
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        raise norm_only(f"Trainer(gradient_clip_algorithm='value', gradient_clip_val={trainer.gradient_clip_val})")
    module = trainer.lightning_module
    if is_overridden("configure_gradient_clipping", module, pl.LightningModule):
        rank_zero_warn(
            "ZeroStrategy clips inside the engine's step, by the global norm: your "
            "LightningModule.configure_gradient_clipping sets that step's max norm when it calls "
            "self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='norm'); clipping the "
            "parameters' .grad directly (torch.nn.utils.clip_grad_norm_) does nothing here: they hold none"
        )


def _train_batch_size(trainer: pl.Trainer) -> int | None:
    """The train dataloader's batch size (Lightning's DeepSpeedStrategy does the same), or None."""
    try:
        loader = train_dataloader_of(trainer)
    except Exception as exc:  # a dataloader that cannot be built twice: fall back to 1, say so
        rank_zero_info(f"ZeroStrategy: could not read the train dataloader's batch size ({exc}); using 1")
        return None
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


class _SkipAwareScheduler:
    """The config's scheduler as Lightning steps it: a step the engine is known to have skipped (fp16
    overflow, read once per step anyway) does not advance it, as in DeepSpeed; everything else (state_dict,
    optimizer, get_last_lr ...) is the scheduler's."""

    def __init__(self, scheduler: Any, engine: ZeroEngine) -> None:
        self.scheduler = scheduler
        self._engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        # Without a host read: a step decided on the device (bf16/fp32) advances it, as the engine's own does.
        if self._engine.step_applied_known() is not False:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)
