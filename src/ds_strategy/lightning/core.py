"""``ZeroCore``: what the Trainer's ``ZeroStrategy`` and Fabric's ``ZeroFabricStrategy`` are, below who calls them.

The two faces differ in who calls them and when (the Trainer's loops build one engine per fit, a Fabric
loop one per ``fabric.setup``); each holds one ``ZeroCore`` (``strategy.core``) for what they do alike:

- the raw config: the user's DeepSpeed config with the strategy's keywords and ``compile`` written in,
  checked once at construction (config.py), and the ZeRO stage it states;
- the keywords that are not config and decide how it is used: ``start_method``, ``on_conflict``,
  ``activation_checkpointing_policy``;
- the launcher: none under a fake process group, else the script launcher or the fork launcher;
- stage 3's init context (``zero.Init``, stage3.py);
- the engine: the config resolved with the face's values, activation checkpointing applied, the engine built;
- one step clipped at another max norm than the config's (``clipping_at``: ``clip_gradients`` on either face).

``ZeroFace`` is the strategy's side of it: ``raw_config`` and ``stage`` on either strategy, answered by its
core. Beside the core: the process layout (devices, ranks, process group, object collectives) is
process.py's ``ProcessLayout``, the precision plugins' dtypes dtypes.py's ``EngineDtypes``, one engine's
checkpoint checkpoint.py's.

Nothing here imports ``lightning.pytorch``: the Fabric face must not need the Trainer's modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, cast

from torch.nn import Module

from ds_strategy.config import OnConflict

from . import stage3
from ._compat import _IS_INTERACTIVE
from .compile import CompileArg
from .config import (
    ConfigArg,
    StartMethod,
    StrategyKeywords,
    configured_stage,
    resolve,
    states_micro_batch,
    strategy_config,
)
from .process import ProcessLayout, fake_ranks

if TYPE_CHECKING:
    import torch
    from torch.optim import Optimizer

    from ds_strategy.config import DeepSpeedConfig
    from ds_strategy.runtime import ZeroEngine
    from ds_strategy.runtime.activation_checkpointing import Policy


class ZeroCore:
    """One strategy's config and the decisions both faces take alike from it (see the module docstring).
    ``owner`` names the strategy in errors."""

    def __init__(
        self,
        owner: str,
        config: ConfigArg,
        keywords: StrategyKeywords,
        compile: CompileArg,
        *,
        start_method: StartMethod,
        on_conflict: OnConflict,
        activation_checkpointing_policy: Policy | None,
    ) -> None:
        self.owner = owner
        self.raw_config: dict[str, Any] = strategy_config(
            owner, config, keywords, compile, start_method=start_method, on_conflict=on_conflict
        )
        self.start_method: StartMethod = start_method
        self.on_conflict: OnConflict = on_conflict
        self.activation_checkpointing_policy = activation_checkpointing_policy

    @classmethod
    def of(cls, owner: str, arguments: Mapping[str, Any]) -> ZeroCore:
        """The core of a strategy from its constructor's arguments (its ``locals()``): both faces take the
        same keywords."""
        return cls(
            owner,
            arguments["config"],
            StrategyKeywords.pick(arguments),
            arguments["compile"],
            start_method=arguments["start_method"],
            on_conflict=arguments["on_conflict"],
            activation_checkpointing_policy=arguments["activation_checkpointing_policy"],
        )

    @property
    def stage(self) -> int:
        return configured_stage(self.raw_config)

    @property
    def sequence_parallel_size(self) -> int:
        """The config's ``sequence_parallel_size`` (1 without Ulysses)."""
        sp = self.raw_config.get("sequence_parallel_size", 1)
        return sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 else 1

    def shard_batch(self, batch: Any) -> Any:
        """With sequence parallelism, a Hugging Face style batch (a mapping with ``input_ids``) becomes this
        rank's slice of each sequence (ds_strategy.sequence.shard_batch, over the engine's active layout);
        any other batch, or no sequence parallelism, is returned as it is."""
        if self.sequence_parallel_size == 1:
            return batch
        from ds_strategy.sequence.batch import shard_if_sequences

        return shard_if_sequences(batch)

    def launcher(self, strategy: ProcessLayout, script: Callable[..., Any], fork: Callable[..., Any]) -> Any:
        """The launcher ``strategy`` starts its ranks with: none when this process stands for a rank of a fake
        group (it is the run), ``script(environment, processes, nodes)`` when each rank re-runs the script,
        ``fork(strategy, start_method=...)`` when the workers are forked or spawned."""
        if fake_ranks(strategy.num_nodes * strategy.num_processes) is not None:
            return None  # this process is the run: nothing to start, no environment to set
        method = start_method_here(self.start_method)
        if method == "popen":
            assert strategy.cluster_environment is not None
            return script(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        return fork(strategy, start_method=method)

    def sharded_init(self) -> AbstractContextManager:
        """At stage 3 modules created inside are partitioned as they are built (``zero.Init``); below, nothing."""
        return stage3.sharded_init(self.raw_config) if self.stage == 3 else nullcontext()

    def micro_batch_size(self, guess: Callable[[], int | None] | None = None) -> int | None:
        """None when the config fixes the micro batch itself; else the face's ``guess`` (asked only then), or 1
        (the engine's bookkeeping only)."""
        if states_micro_batch(self.raw_config):
            return None
        return (guess() if guess is not None else None) or 1

    def resolve(
        self,
        *,
        world_size: int,
        precision: str,
        micro_batch_size: int | None,
        accumulate_grad_batches: int,
        gradient_clip_val: float | None,
    ) -> DeepSpeedConfig:
        """The raw config resolved with the face's values (config.py ``resolve``; ``on_conflict`` decides)."""
        return resolve(
            self.raw_config,
            world_size=world_size,
            precision=precision,
            micro_batch_size=micro_batch_size,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val,
            on_conflict=self.on_conflict,
        )

    def build_engine(
        self, module: Module, config: DeepSpeedConfig, optimizer: Optimizer | None, device: torch.device
    ) -> ZeroEngine:
        """``activation_checkpointing_policy`` applied to ``module``, then one engine over it."""
        from ds_strategy.runtime import ZeroEngine

        checkpoint_activations(module, self.activation_checkpointing_policy)
        refuse_pipeline_module(module)
        # The stage-3 engine is selected by the config's stage inside ZeroEngine (runtime.zero.STAGES).
        return ZeroEngine(module, config, optimizer=optimizer, device=device)


class ZeroFace:
    """The attributes both strategies answer from their ``core`` (put first in the bases)."""

    core: ZeroCore

    @property
    def raw_config(self) -> dict[str, Any]:
        """The strategy's DeepSpeed config as a dict, keywords written in ("auto" entries unresolved)."""
        return self.core.raw_config

    @property
    def stage(self) -> int:
        return self.core.stage

    @property
    def sequence_parallel_size(self) -> int:
        return self.core.sequence_parallel_size


def start_method_here(start_method: str) -> Literal["popen", "fork", "spawn"]:
    """The launch method a strategy's ``start_method`` means here: "auto" forks in a notebook (there is no
    script to re-run) and starts each rank as a fresh script process otherwise."""
    if start_method == "auto":
        return "fork" if _IS_INTERACTIVE else "popen"
    return cast(Literal["popen", "fork", "spawn"], start_method)  # checked at construction (strategy_config)


def checkpoint_activations(module: Module, policy: Policy | None) -> None:
    """``activation_checkpointing_policy``: the picked submodules recompute their activations in backward
    (applied before the engine is built; parameter names do not change)."""
    if policy is None:
        return
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    from ds_strategy.runtime.activation_checkpointing import apply_activation_checkpointing

    picked = apply_activation_checkpointing(module, policy)
    rank_zero_info(f"activation checkpointing: {len(picked)} modules recompute their activations in backward")


def refuse_pipeline_module(module: Module) -> None:
    """A PipelineModule cannot train through Lightning: say which path it can train on (docs/pipeline.md)."""
    from ds_strategy.runtime.pipe import PipelineModule

    for name, sub in module.named_modules():
        if isinstance(sub, PipelineModule):
            where = f"{type(module).__name__}.{name}" if name else type(module).__name__
            raise ValueError(
                f"{where} is a ds_strategy.pipe.PipelineModule: pipeline parallelism trains through "
                "ds_strategy.initialize(model=pipeline_module, config=...) and engine.train_batch(data_iter), "
                "launched with `ds-launch --num_procs N train.py` (or torchrun); Lightning's training_step runs "
                "one forward and backward per batch on every rank and cannot drive the 1F1B schedule across "
                "stages (docs/pipeline.md). Use ZeroStrategy with a plain nn.Module, or train the PipelineModule "
                "with initialize()"
            )


@contextmanager
def clipping_at(engine: ZeroEngine, max_norm: float | None) -> Iterator[None]:
    """The engine's steps inside clip by ``max_norm`` instead of the config's ``gradient_clipping`` (None: the
    config's): ``fabric.clip_gradients`` and a LightningModule's ``self.clip_gradients`` ask for one step."""
    if max_norm is None:
        yield
        return
    configured = engine.config
    engine.config = replace(configured, gradient_clipping=float(max_norm))
    try:
        yield
    finally:
        engine.config = configured
