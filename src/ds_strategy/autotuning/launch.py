"""The tune behind ``ds-launch --autotuning tune|run``: the user's ``initialize`` call, intercepted.

script.py runs the user's script with ``AutotuneInterceptor(mode)`` installed on ``initialize``
(runtime/initialize.py, [Note: the initialize hook]). At the script's first ``initialize`` call it:

1. requires the config's ``autotuning.enabled`` (the switch DeepSpeed's launcher reads too) and
   ``training_data`` (what the trials feed on);
2. snapshots the model onto the CPU before anything trains (every trial, and the profiling step, builds its
   own deep copy) and turns an optimizer instance into a factory of the same type and defaults;
3. runs ``autotune`` on every rank (tune.py), which writes ``results_dir``;
4. ``tune``: ends every rank with status 0 after a barrier; ``run``: applies the winner to the user's model
   (activation checkpointing, when it won) and returns the real ``initialize`` with the winner's config and
   the call's other arguments: the script trains on, its dataloader with the winner's micro batch.

Later ``initialize`` calls of the same script (an evaluation engine, say) go to the real ``initialize`` as
they are. The helpers ``model_snapshot``, ``optimizer_factory`` and ``dataset_batches`` serve the Lightning
face too (lightning/tuner.py).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import IterableDataset, default_collate

from ds_strategy.config import DeepSpeedConfig
from ds_strategy.runtime.initialize import initialize
from ds_strategy.runtime.pipe.module import PipelineModule

from .tune import AutotuneResult, autotune, sequence_parallel_of

MODES = ("tune", "run")


class AutotuneInterceptor:
    """The interceptor script.py installs on ``initialize`` (see the module docstring)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"ds-launch --autotuning: got mode {mode!r}; expected one of {', '.join(MODES)}")
        self.mode = mode
        self.called = False
        self.result: AutotuneResult | None = None

    def __call__(self, arguments: dict[str, Any]) -> Any:
        if self.called:  # the script's later engines: as it asked for them
            return initialize(**arguments)
        self.called = True
        what = f"ds-launch --autotuning {self.mode}"
        require_enabled(arguments["config"], what)
        if arguments["process_group"] is not None or arguments["mpu"] is not None:
            raise ValueError(
                f"{what} tunes data-parallel ZeRO over every rank: initialize(process_group=...) and "
                "initialize(mpu=...) are not supported; drop them, or tune without ds-launch --autotuning"
            )
        model = arguments["model"]
        if isinstance(model, PipelineModule):
            raise ValueError(f"{what}: a PipelineModule is not tuned (the autotuner searches data-parallel ZeRO)")
        data = arguments["training_data"]
        if data is None:
            raise ValueError(
                f"{what}: initialize() was called without training_data, and the trials feed on it: pass "
                "initialize(training_data=dataset, ...) with a map-style dataset"
            )
        pristine = [model_snapshot(model)]  # emptied after the tune: no CPU copy while the winner trains
        result = autotune(
            lambda: copy.deepcopy(pristine[0]),
            dataset_batches(data, arguments["collate_fn"], sequence_parallel=sequence_parallel_of(arguments["config"])),
            arguments["config"],
            optimizer=optimizer_factory(arguments["optimizer"]),
            device=arguments["device"],
        )
        pristine.clear()
        self.result = result
        if result.best is None or result.best_config is None:
            raise RuntimeError(
                f"{what}: no configuration fitted (every trial failed or went over the memory cap); see "
                f"{result.results_dir / 'trials.json'}"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.mode == "tune":
            if rank == 0:
                print(
                    f"{what}: the best configuration is {result.best.candidate.name}; train with "
                    f"{result.results_dir / 'ds_config.json'}",
                    flush=True,
                )
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
            raise SystemExit(0)
        if rank == 0:
            print(f"{what}: training with the best configuration, {result.best.candidate.name}", flush=True)
        result.apply(model)
        return initialize(**{**arguments, "config": result.best_config})


def require_enabled(config: Any, what: str) -> None:
    """Raise unless the config's ``autotuning.enabled`` is true, naming the key and where the config came from."""
    if isinstance(config, DeepSpeedConfig):
        enabled, where = config.autotuning.enabled, "the DeepSpeedConfig given to initialize()"
    else:
        if isinstance(config, Mapping):
            raw: Any = config
            where = "the config dict given to initialize()"
        elif isinstance(config, str) and config.lstrip().startswith("{"):
            raw, where = json.loads(config), "the JSON text given to initialize()"
        else:
            raw, where = json.loads(Path(os.fspath(config)).read_text()), str(config)
        block = raw.get("autotuning") if isinstance(raw, Mapping) else None
        enabled = isinstance(block, Mapping) and block.get("enabled") is True
    if not enabled:
        raise ValueError(
            f'{what}: autotuning.enabled is not true in {where}: add "autotuning": {{"enabled": true, ...}} to the '
            "config (docs/autotuning.md)"
        )


def model_snapshot(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` on the CPU: the pristine weights every trial starts from."""
    return copy.deepcopy(model).to("cpu")


def optimizer_factory(optimizer: Any) -> Any:
    """An optimizer instance as a factory ``params -> a new optimizer of its type and defaults`` (each trial
    builds its own); a callable or None passes through."""
    if not isinstance(optimizer, Optimizer):
        return optimizer
    kind = type(optimizer)
    accepted = inspect.signature(kind.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    # Only what the constructor takes: torch's AdamW records decoupled_weight_decay in its defaults, say.
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    try:
        kind([nn.Parameter(torch.zeros(1))], **defaults)
    except TypeError as err:
        raise TypeError(
            f"autotune: cannot build a new {kind.__name__} for each trial from its defaults ({err}); pass "
            "optimizer=lambda params: ... (a factory) or use the config's optimizer block"
        ) from err

    def make(params: Any) -> Optimizer:
        return kind(params, **defaults)

    return make


def dataset_batches(
    dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None, *, sequence_parallel: int = 1
) -> Any:
    """The autotuner's ``data`` for a dataset a DataLoader reads with ``collate_fn``: the dataset itself when
    it is collated the default way, else a ``(micro_batch_size, step) -> batch`` function collating this
    rank's samples (autotuning/data.py's order) with ``collate_fn``; the ``sequence_parallel`` consecutive
    ranks of a sequence-parallel group read the same samples."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            f"autotune: the training data is a {type(dataset).__name__}; the trials need a map-style dataset "
            "(len() and indexing) to read batches of every micro-batch size"
        )
    if collate_fn is None or collate_fn is default_collate:
        return dataset
    size = len(dataset)
    if size == 0:
        raise ValueError("autotune data: the dataset is empty")
    rank = (dist.get_rank() if dist.is_initialized() else 0) // sequence_parallel
    world = (dist.get_world_size() if dist.is_initialized() else 1) // sequence_parallel

    def collated(micro: int, step: int) -> Any:
        start = (step * world + rank) * micro
        return collate_fn([dataset[(start + i) % size] for i in range(micro)])

    return collated


__all__ = [
    "MODES",
    "AutotuneInterceptor",
    "dataset_batches",
    "model_snapshot",
    "optimizer_factory",
    "require_enabled",
]
