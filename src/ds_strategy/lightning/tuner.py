"""``ZeroTuner``: the autotuner for the Trainer face, used like Lightning's ``Tuner``: tune, then fit.

    trainer = Trainer(strategy=ZeroStrategy(config=...), accelerator="gpu", devices=8)
    result = ZeroTuner(trainer).autotune(model, datamodule=dm)   # every rank, before fit
    trainer.fit(model, datamodule=dm)                             # trains with the winner

The tune runs in the processes that train (Lightning's ``Tuner.scale_batch_size`` runs inside a fit; this
one runs before it): the strategy's ranks are started now, as ``Trainer.init_module`` does at stage 3, and
``ds_strategy.autotune`` (autotuning/tune.py) runs its trials on a CPU snapshot of the LightningModule, each
trial's engine fed with the train dataloader's dataset and collate function and its loss taken from
``training_step`` (a tensor, or a dict with ``"loss"``) called through the engine's forward as Lightning
calls it. The base configuration is the strategy's, with the batch the Trainer would train with (the
dataloader's batch size x ``accumulate_grad_batches`` x world size, held by every candidate), its precision
and its clipping. Afterwards the winner is the strategy's config, ``accumulate_grad_batches`` the winner's,
``batch_size`` on the model / datamodule the winner's micro batch (``lightning_setattr``, as
``scale_batch_size`` sets it) and, when it won, every repeated block of the model checkpoints activations.

Trials have no Trainer: ``self.log`` calls in ``training_step`` are dropped during the tune (Lightning's
"self.trainer reference is not registered" warning is silenced for it), and a ``training_step`` that needs
``self.trainer`` fails its trials. A ``DataLoader`` passed as ``train_dataloaders`` fixes its batch size, so
only the stage, offload and checkpointing are tuned then; pass a datamodule (or let the model build its
loader) with a ``batch_size`` attribute to tune the micro batch too.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from torch.optim import Optimizer

from ds_strategy.autotuning.launch import dataset_batches, model_snapshot, optimizer_factory
from ds_strategy.autotuning.space import SearchSpace
from ds_strategy.autotuning.tune import autotune, sequence_parallel_of

from .strategy import ZeroStrategy

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from ds_strategy.autotuning.tune import AutotuneResult

_NO_TRAINER_LOG = r"You are trying to `self.log\(\)` but the `self.trainer` reference is not registered"


class ZeroTuner:
    """Tune a ``ZeroStrategy`` Trainer's configuration before fit (see the module docstring)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    def autotune(
        self,
        model: pl.LightningModule,
        train_dataloaders: DataLoader[Any] | None = None,
        datamodule: pl.LightningDataModule | None = None,
        *,
        space: SearchSpace | None = None,
        time_budget_s: float | None = None,
        trial_timeout_s: float = 300.0,
        verbose: bool = True,
    ) -> AutotuneResult:
        """Find the fastest configuration that fits and make the Trainer use it; every rank calls it with the
        same arguments, before ``trainer.fit(model, ...)`` with the same model and data. ``space``,
        ``time_budget_s``, ``trial_timeout_s`` and ``verbose`` are ``ds_strategy.autotune``'s; the strategy's
        ``autotuning`` config block sets the rest. Returns the ``AutotuneResult``."""
        trainer = self._trainer
        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            raise TypeError(
                f"ZeroTuner tunes a ZeroStrategy's configuration, but the Trainer's strategy is "
                f"{type(strategy).__name__}: use Trainer(strategy=ZeroStrategy(...)) or a name such as 'zero2'"
            )
        if train_dataloaders is not None and datamodule is not None:
            raise ValueError("ZeroTuner.autotune: pass train_dataloaders or datamodule, not both (as Trainer.fit)")
        if not model.automatic_optimization:
            raise ValueError(
                "ZeroTuner.autotune: the trials run training_step's loss through the engine's backward and step; "
                "manual optimization (automatic_optimization = False) is not tuned"
            )
        block = strategy.raw_config.get("autotuning")
        if isinstance(block, Mapping) and block.get("enabled") is False:
            raise ValueError(
                'ZeroTuner.autotune: the strategy\'s config says "autotuning": {"enabled": false}; set it to true '
                "(or drop the key) to tune"
            )
        fixed_micro = train_dataloaders is not None
        if not fixed_micro and not _has_batch_size(model, datamodule):
            raise AttributeError(
                "ZeroTuner.autotune sets the winner's micro batch as model.batch_size (or model.hparams.batch_size, "
                "or datamodule.batch_size), and neither the model nor the datamodule has one: expose batch_size "
                "and build the train DataLoader with it, or pass train_dataloaders=loader to keep its batch size"
            )
        if not strategy._ranks_ready_for_init():
            raise RuntimeError(
                "ZeroTuner.autotune runs the tune in the processes that train, and in a notebook they start only at "
                "fit: run the script with python, ds-launch or torchrun"
            )
        loader = _train_loader(model, train_dataloaders, datamodule, strategy)
        if fixed_micro:
            space = dataclasses.replace(space or SearchSpace(), micro_batches=(_batch_size(loader),))
        base = _base_config(trainer, strategy, loader)
        snapshot = model_snapshot(model)
        assert isinstance(snapshot, pl.LightningModule)
        pristine = [snapshot]  # emptied after the tune: no CPU copy while fit trains
        optimizer = _configured_optimizer(snapshot, base)
        del snapshot
        rank = dist.get_rank() if dist.is_initialized() else 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_TRAINER_LOG)
            result = autotune(
                lambda: copy.deepcopy(pristine[0]),
                dataset_batches(loader.dataset, loader.collate_fn, sequence_parallel=sequence_parallel_of(base)),
                base,
                loss_fn=training_step_loss,
                optimizer=optimizer_factory(optimizer),
                space=space,
                time_budget_s=time_budget_s,
                device=strategy.root_device,
                trial_timeout_s=trial_timeout_s,
                verbose=verbose and rank == 0,
            )
        pristine.clear()
        if result.best is None or result.best_config is None:
            raise RuntimeError(
                "ZeroTuner.autotune: no configuration fitted (every trial failed or went over the memory cap); see "
                f"{result.results_dir / 'trials.json'}"
            )
        best = result.best.candidate
        result.apply(model)
        if not fixed_micro:
            _set_batch_size(model, datamodule, best.micro_batch)
        trainer.accumulate_grad_batches = best.accumulation
        strategy.config = copy.deepcopy(result.best_config)
        strategy.core.raw_config = copy.deepcopy(result.best_config)
        return result


def training_step_loss(engine: Any, batch: Any) -> torch.Tensor:
    """``training_step(batch, 0)`` of the engine's LightningModule, run inside the engine's forward (its input
    casting and hooks), as the Trainer runs it; the loss it returns (a tensor or a dict with ``"loss"``). The
    profiling step passes the bare module: its ``training_step`` is called directly."""
    bare = isinstance(engine, pl.LightningModule)
    out = engine.training_step(batch, 0) if bare else _through_forward(engine, batch)
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"ZeroTuner: training_step returned {type(out).__name__}; the trials need the loss (a scalar tensor or "
            'a dict with "loss")'
        )
    return loss


def _through_forward(engine: Any, batch: Any) -> Any:
    """``engine(batch, 0)`` with the module's forward redirected to its ``training_step`` for the one call."""
    module = engine.module
    own = "forward" in vars(module)
    original = module.forward

    def step(*args: Any, **kwargs: Any) -> Any:
        _restore_forward(module, original, own)  # training_step's own self(x) is the real forward
        return module.training_step(*args, **kwargs)

    module.forward = step
    try:
        return engine(batch, 0)
    finally:
        _restore_forward(module, original, own)


def _restore_forward(module: Any, original: Any, own: bool) -> None:
    if own:
        module.forward = original
    else:
        vars(module).pop("forward", None)


def _has_batch_size(model: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> bool:
    return lightning_hasattr(model, "batch_size") or _datamodule_holds_batch_size(datamodule)


def _datamodule_holds_batch_size(datamodule: pl.LightningDataModule | None) -> bool:
    return datamodule is not None and (hasattr(datamodule, "batch_size") or "batch_size" in datamodule.hparams)


def _set_batch_size(model: pl.LightningModule, datamodule: pl.LightningDataModule | None, size: int) -> None:
    """``batch_size = size`` wherever ``scale_batch_size`` would set it (the model, its hparams, the
    datamodule and its hparams), then a check that the train dataloader now batches ``size``."""
    if lightning_hasattr(model, "batch_size"):
        lightning_setattr(model, "batch_size", size)
    if datamodule is not None:
        if hasattr(datamodule, "batch_size"):
            datamodule.batch_size = size
        if "batch_size" in datamodule.hparams:
            datamodule.hparams["batch_size"] = size
    source: Any = datamodule if datamodule is not None else model
    rebuilt = _batch_size(source.train_dataloader())
    if rebuilt != size:
        raise ValueError(
            f"ZeroTuner.autotune set batch_size = {size} (the winner's micro batch), but "
            f"{type(source).__name__}.train_dataloader() still batches {rebuilt}: build the DataLoader with "
            "batch_size=self.batch_size"
        )


def _train_loader(
    model: pl.LightningModule,
    loaders: Any,
    datamodule: pl.LightningDataModule | None,
    strategy: ZeroStrategy,
) -> DataLoader[Any]:
    """The train dataloader fit would read: the one given, the datamodule's (after ``prepare_data`` on the
    ranks Lightning runs it on, and ``setup("fit")``) or the model's."""
    if loaders is None and datamodule is not None:
        first = strategy.local_rank == 0 if datamodule.prepare_data_per_node else strategy.global_rank == 0
        if first:
            datamodule.prepare_data()
        strategy.barrier()
        datamodule.setup("fit")
        loaders = datamodule.train_dataloader()
    elif loaders is None:
        loaders = model.train_dataloader()
    if isinstance(loaders, (list, tuple, Mapping)):
        raise TypeError(
            "ZeroTuner.autotune reads one train DataLoader; several (a list or dict of loaders) are not tuned"
        )
    if not hasattr(loaders, "dataset") or not hasattr(loaders, "collate_fn"):
        raise TypeError(
            f"ZeroTuner.autotune needs a torch DataLoader to read batches from, got {type(loaders).__name__}"
        )
    return loaders


def _batch_size(loader: Any) -> int:
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        raise ValueError(
            "ZeroTuner.autotune: the train DataLoader has no batch_size (a custom batch_sampler): build it with "
            "batch_size=..."
        )
    return size


def _base_config(trainer: pl.Trainer, strategy: ZeroStrategy, loader: Any) -> dict[str, Any]:
    """The strategy's raw config with what the Trainer decides written in: the batch triple (the dataloader's
    batch size, ``accumulate_grad_batches``, the world size), the precision and the clipping."""
    resolved = strategy.core.resolve(
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        precision=strategy.precision_plugin.precision,
        micro_batch_size=strategy.core.micro_batch_size(lambda: _batch_size(loader)),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
    )
    base = copy.deepcopy(strategy.raw_config)
    base["train_batch_size"] = resolved.train_batch_size
    base["train_micro_batch_size_per_gpu"] = resolved.train_micro_batch_size_per_gpu
    base["gradient_accumulation_steps"] = resolved.gradient_accumulation_steps
    base["gradient_clipping"] = resolved.gradient_clipping
    for name, enabled in (("fp16", resolved.fp16.enabled), ("bf16", resolved.bf16.enabled)):
        section = dict(base.get(name) or {})
        if section or enabled:
            base[name] = {**section, "enabled": bool(enabled)}
    return base


def _configured_optimizer(module: pl.LightningModule, base: Mapping[str, Any]) -> Optimizer | None:
    """The optimizer ``configure_optimizers`` returns (its type and defaults make each trial's), or None for the
    config's ``optimizer`` block."""
    if not is_overridden("configure_optimizers", module, pl.LightningModule):
        return None
    try:
        conf = module.configure_optimizers()
    except RuntimeError as err:
        raise RuntimeError(
            f"ZeroTuner.autotune calls configure_optimizers() before fit, without a Trainer attached, and it raised "
            f"({err}); put the optimizer in the config's optimizer block instead"
        ) from err
    if isinstance(conf, Mapping):
        conf = conf.get("optimizer")
    if isinstance(conf, (list, tuple)):
        conf = conf[0] if conf else None
        if isinstance(conf, (list, tuple)):  # ([optimizers], [schedulers])
            conf = conf[0] if conf else None
        if isinstance(conf, Mapping):
            conf = conf.get("optimizer")
    if conf is not None and not isinstance(conf, Optimizer):
        raise TypeError(f"ZeroTuner.autotune: configure_optimizers returned {type(conf).__name__}, not an optimizer")
    if conf is not None and base.get("optimizer") is not None:
        raise ValueError(
            'ZeroTuner.autotune: configure_optimizers returned an optimizer and the config has an "optimizer" block; '
            "use one (ZeroStrategy refuses both at fit too)"
        )
    return conf
