"""``ds_strategy.initialize``: DeepSpeed's entry point for plain PyTorch loops.

engine, optimizer, loader, scheduler = ds_strategy.initialize(model=m, model_parameters=m.parameters(),
                                                              training_data=ds, config="ds_config.json")

[Note: the initialize hook]
``ds-launch --autotuning tune|run`` runs the user's script unchanged and tunes inside its call to
``initialize``: ``intercepted(fn)`` installs ``fn`` for the duration of a ``with`` block, and every
``initialize`` call made meanwhile, once its config argument is resolved and torch.distributed is up, returns
``fn(arguments)`` instead (``arguments``: the call's keyword arguments as a dict, ``config`` resolved from
``config_params`` / ``args.deepspeed_config``). While ``fn`` runs the hook is cleared, so the engines ``fn``
builds (the autotuner's trials, the winner's) come from the real ``initialize``. The runtime does not import
the autotuner (it sits a layer above): the autotuner installs the hook (autotuning/launch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ds_strategy.comm import init_distributed
from ds_strategy.config import DeepSpeedConfig, load_config
from ds_strategy.config.loader import ConfigInput

from .engine import SchedulerArg, ZeroEngine
from .params import OptimizerArg, ParamsArg
from .pipe.config import apply_pipeline_config
from .pipe.engine import PipelineEngine
from .pipe.module import PipelineModule

Interceptor = Callable[[dict[str, Any]], Any]
_interceptor: Interceptor | None = None  # see [Note: the initialize hook]


@contextmanager
def intercepted(fn: Interceptor) -> Iterator[None]:
    """Route every ``initialize`` call inside the block to ``fn`` (see [Note: the initialize hook])."""
    global _interceptor
    previous, _interceptor = _interceptor, fn
    try:
        yield
    finally:
        _interceptor = previous


def _intercept(hook: Interceptor, arguments: dict[str, Any]) -> Any:
    """``hook(arguments)`` with the hook cleared while it runs: its own ``initialize`` calls are real."""
    global _interceptor
    _interceptor = None
    try:
        return hook(arguments)
    finally:
        _interceptor = hook


def _ensure_distributed(dist_init_required: bool | None) -> None:
    """Use the caller's torch.distributed group, or set one up through ``ds_strategy.init_distributed``
    (env variables of torchrun / ds-launch / Lightning, MPI or SLURM discovery, else a single process)."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialised; call "
            "ds_strategy.init_distributed() first or leave dist_init_required unset"
        )
    init_distributed()


def initialize(
    args: Any = None,
    *,
    model: nn.Module,
    optimizer: OptimizerArg = None,
    model_parameters: ParamsArg = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: SchedulerArg = None,
    config: ConfigInput | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    dist_init_required: bool | None = None,
    config_params: ConfigInput | None = None,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    mpu: Any = None,
) -> tuple[ZeroEngine, Optimizer | None, DataLoader[Any] | None, Any]:
    """Build the engine; return ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer``: a torch optimizer over the model's parameters (its param groups are rewired to the
    flat fp32 masters; don't call its ``step`` yourself, ``engine.step()`` does), a callable taking
    param groups, or None for the config's ``optimizer`` block. ``lr_scheduler``: a scheduler, a callable
    taking the optimizer, or None for the config's ``scheduler`` block; the engine steps it after every
    applied optimizer step. ``config`` (or the legacy ``config_params``, or ``args.deepspeed_config``):
    a dict, a JSON path or a ``DeepSpeedConfig``. ``device``: where the model trains (default: where its
    parameters already are on an accelerator, else the current CUDA device, else the CPU). ``mpu``:
    Megatron's model-parallel unit: ZeRO runs over its data-parallel group (unless ``process_group`` is
    given) and activation checkpointing partitions over its model-parallel group.
    ``training_data`` becomes a DataLoader with a
    DistributedSampler and the micro batch size.
    """
    if config is not None and config_params is not None:
        raise ValueError("pass the DeepSpeed config once: config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise ValueError(
            f"initialize() got two DeepSpeed configs: args.deepspeed_config={from_args!r} and config=; "
            "pass one (DeepSpeed refuses this too)"
        )
    if config is None:
        config = from_args
    if config is None:
        raise ValueError("initialize() needs a config: config=dict, a JSON file path or a DeepSpeedConfig")
    _ensure_distributed(dist_init_required)
    if _interceptor is not None:
        return _intercept(
            _interceptor,
            {
                "args": args,
                "model": model,
                "optimizer": optimizer,
                "model_parameters": model_parameters,
                "training_data": training_data,
                "lr_scheduler": lr_scheduler,
                "config": config,
                "collate_fn": collate_fn,
                "dist_init_required": dist_init_required,
                "process_group": process_group,
                "device": device,
                "mpu": mpu,
            },
        )
    if mpu is not None and process_group is None:
        process_group = mpu.get_data_parallel_group()
    pipeline = model if isinstance(model, PipelineModule) else None
    if pipeline is not None:  # ZeRO runs over the data-parallel group of the model's topology
        if process_group is not None or mpu is not None:
            raise ValueError(
                "initialize(model=PipelineModule, ...) takes its data-parallel group from the module's topology; "
                "leave process_group= and mpu= unset"
            )
        process_group = pipeline.groups.data_group
    world = dist.get_world_size(process_group)
    resolved: DeepSpeedConfig = load_config(config, world_size=world)
    if pipeline is not None:
        if resolved.sequence_parallel_size > 1:
            raise ValueError(
                f"initialize(model=PipelineModule, ...) with sequence_parallel_size={resolved.sequence_parallel_size}: "
                "Ulysses sequence parallelism inside pipeline stages is not built; use one or the other"
            )
        resolved = apply_pipeline_config(pipeline, resolved)
    engine = ZeroEngine(
        model,
        resolved,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        process_group=process_group,
        device=device,
        mpu=mpu,
    )
    loader = None
    if training_data is not None:
        # DeepSpeed's pipeline engine reads its data in order (its sampler does not shuffle); the others shuffle.
        loader = build_dataloader(training_data, engine, collate_fn=collate_fn, shuffle=pipeline is None)
        engine.training_dataloader = loader
    if pipeline is not None:
        pipe = PipelineEngine(pipeline, engine)
        pipe.training_dataloader = loader
        return pipe, engine.optimizer, loader, engine.lr_scheduler  # type: ignore[return-value]
    return engine, engine.optimizer, loader, engine.lr_scheduler


def build_dataloader(
    dataset: Dataset[Any],
    engine: ZeroEngine,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> DataLoader[Any]:
    """Micro batches of this rank's share of ``dataset`` (DistributedSampler; iterable datasets as is).

    Call ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle, as with any DistributedSampler.
    """
    micro = engine.train_micro_batch_size_per_gpu()
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=micro, collate_fn=collate_fn)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=engine.dp_world_size, rank=engine.dp_rank, shuffle=shuffle, seed=seed
    )
    return DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate_fn)
