"""What both Lightning faces do with the engine, written once.

``ZeroStrategy`` (the Trainer's) and ``ZeroFabricStrategy`` (Fabric's) differ in who calls them and when;
below that they do the same things, and those live here:

- the compute device of a rank and the process group (from a Lightning cluster environment);
- Lightning's precision flags mapped onto the engine's fp16 / bf16 / fp32 (``precision_flag``);
- building a ``ZeroEngine`` from the raw config and the face's context (``build_engine``);
- the sharded checkpoint of one engine (``save_engine`` / ``load_engine``, the tag of checkpoint.py);
- the object collectives (barrier, broadcast of a picklable object);
- torch's fake process group, initialised by the user before fit: one process (``devices=1``) stands for
  rank r of N (see [Note: one process for N ranks]).

Nothing here imports ``lightning.pytorch``: the Fabric face must not need the Trainer's modules.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, get_args

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from ds_strategy.accelerator import get_accelerator
from ds_strategy.comm import init_distributed, is_fake_group
from ds_strategy.config import OnConflict

from . import checkpoint as lckpt
from ._compat import (
    _IS_INTERACTIVE,
    _convert_fp_tensor,
    _distributed_is_initialized,
    _DtypeContextManager,
    _get_default_process_group_backend_for_device,
    _group,
)
from .config import resolve

if TYPE_CHECKING:
    from ds_strategy.config import DeepSpeedConfig
    from ds_strategy.runtime import ZeroEngine
    from ds_strategy.runtime.activation_checkpointing import Policy

T = TypeVar("T")
P = TypeVar("P")

PrecisionFlag = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
PRECISION_FLAGS: tuple[str, ...] = get_args(PrecisionFlag)
PRECISION_DTYPE: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}


# ---------------------------------------------------------------------- device and process group
def start_method_here(start_method: str) -> Literal["popen", "fork", "spawn"]:
    """The launch method a strategy's ``start_method`` means here: "auto" forks in a notebook (there is no
    script to re-run) and starts each rank as a fresh script process otherwise."""
    if start_method == "auto":
        return "fork" if _IS_INTERACTIVE else "popen"
    return cast(Literal["popen", "fork", "spawn"], start_method)  # checked at construction (strategy_config)


def compute_device(device: torch.device) -> torch.device:
    """The device a rank computes on: Lightning's CPU devices are plain "cpu"; the device-strict mode
    computes on "cpu:0" (strict.py), so the CPU is asked of the accelerator."""
    return get_accelerator("cpu").device() if device.type == "cpu" else device


def default_backend(device: torch.device) -> str:
    """The torch.distributed backend when the user chose none: nccl on CUDA, gloo on CPU."""
    return _get_default_process_group_backend_for_device(device)


def init_process_group(env: ClusterEnvironment, backend: str, timeout: timedelta | None) -> None:
    """torch.distributed's default group from Lightning's cluster environment (torchelastic, SLURM, LSF,
    MPI, plain); a group that already exists (an earlier fit, a user's own) is reused."""
    if is_fake_group():  # nothing to rendezvous with: no address to publish (see [Note: one process for N ranks])
        init_distributed(set_device=False)
        return
    # env:// (not tcp://) so that under torchrun the workers join the elastic agent's store.
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    # Reusing a group: only a timeout the user chose is worth a warning that it cannot apply any more.
    reused_default = torch.distributed.is_initialized() and timeout == default_pg_timeout
    init_distributed(
        dist_backend=backend,
        rank=env.global_rank(),
        world_size=env.world_size(),
        timeout=None if reused_default else timeout,
        set_device=False,  # Lightning placed this rank on its device (devices=[2, 3] is not LOCAL_RANK)
    )


# [Note: one process for N ranks]
# torch's fake process group ([Note: the fake process group] in comm/distributed.py), initialised before
# fit with ``init_process_group("fake", store=FakeStore(), rank=r, world_size=N)``, lets one process run what
# rank r of N does. Lightning launches that one process (``devices=1``) and would count a world of one; the
# strategy instead takes the group's rank and size (``fake_ranks``) for everything that depends on them:
# Lightning's global rank and world size (so rank_zero_only is rank r's), the DistributedSampler (rank r's
# 1/N of the data), the engine's config (train_batch_size = micro x accumulation x N) and its process
# group (the fake one). Collectives return at once with this rank's own data, so an object broadcast
# returns the caller's object and a boolean decision is this rank's (every simulated rank decides alike);
# tensor reductions through ``reduce`` run and their values are not the other ranks'. ``devices`` above 1
# with a fake group is an error: the other processes could not join it.


def fake_ranks(num_processes: int) -> tuple[int, int] | None:
    """(rank, world size) of the fake process group this process stands in for (see [Note: one process for
    N ranks]); None without one. ``num_processes``: the processes Lightning runs (must be 1 then)."""
    if not is_fake_group():
        return None
    if num_processes != 1:
        raise ValueError(
            f"torch.distributed is initialised with the fake backend (one process standing for "
            f"{torch.distributed.get_world_size()} ranks), but Lightning would run {num_processes} processes: "
            "use devices=1 and num_nodes=1 with a fake process group"
        )
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


# ---------------------------------------------------------------------- precision
class ProcessLayout:
    """What the Trainer and Fabric faces answer alike about this process's place in the job (put before
    Lightning's ParallelStrategy in the bases): devices, ranks, the sampler, the process group, collectives."""

    if TYPE_CHECKING:  # provided by Lightning's ParallelStrategy
        parallel_devices: list[torch.device] | None
        cluster_environment: ClusterEnvironment | None
        local_rank: int
        global_rank: int
        node_rank: int
        raw_config: dict[str, Any]
        _num_nodes: int
        _process_group_backend: str | None
        _timeout: timedelta | None

    @property
    def stage(self) -> int:
        from .config import configured_stage

        return configured_stage(self.raw_config)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return compute_device(self.parallel_devices[self.local_rank])

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        fake = fake_ranks(self.num_nodes * self.num_processes)
        if fake is not None:  # this process reads rank r's share of the data
            return {"num_replicas": fake[1], "rank": fake[0]}
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        from lightning_utilities.core.rank_zero import rank_zero_only

        fake = fake_ranks(self.num_nodes * self.num_processes)
        if self.cluster_environment is not None and fake is not None:
            self.cluster_environment.set_global_rank(fake[0])
            self.cluster_environment.set_world_size(fake[1])
        elif self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def start_process_group(self) -> None:
        """Ranks, then the default process group (the backend the device takes unless one was named)."""
        self.set_world_ranks()
        if is_fake_group():
            self._process_group_backend = str(torch.distributed.get_backend())
        self._process_group_backend = self._process_group_backend or default_backend(self.root_device)
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return broadcast_object(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if is_fake_group():  # every simulated rank decides as this one does (see [Note: one process for N ranks])
            return bool(decision)
        base: Any = super()
        return bool(base.reduce_boolean_decision(decision, all=all))


def own_precision(plugin: Any, ours: type[P], plain_types: tuple[type, ...], *, owner: str, where: str) -> P | None:
    """The face's own precision plugin (``ours``) in place of the one Lightning built from its ``precision``
    flag, so that Lightning's AMP (autocast + GradScaler) never wraps the engine's own casting and loss
    scaling. Only the plain plugins (``plain_types``) carry a flag the engine can take over."""
    if plugin is None or isinstance(plugin, ours):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin) not in plain_types or flag not in PRECISION_FLAGS:
        what = "64-bit" if flag == "64-true" else f"{type(plugin).__name__}(precision={flag!r})"
        raise TypeError(
            f"{owner} does not support {what}; use {where} with "
            f"{', '.join(repr(p) for p in PRECISION_FLAGS[:-1])} or {PRECISION_FLAGS[-1]!r}, or pass "
            f"plugins=[ds_strategy.lightning.{ours.__name__}(...)]"
        )
    return ours(flag)  # type: ignore[call-arg]


def check_precision_flag(precision: Any, owner: str) -> PrecisionFlag:
    precision = str(precision)
    if precision not in PRECISION_FLAGS:
        raise ValueError(
            f"{owner} does not support precision={precision!r}; choose one of "
            f"{', '.join(repr(p) for p in PRECISION_FLAGS)}"
        )
    return cast(PrecisionFlag, precision)


class EngineDtypes:
    """The dtype half of both precision plugins (mixed into ``ZeroPrecision`` and ``ZeroFabricPrecision``).

    ``"16-mixed"`` / ``"16-true"`` select the engine's fp16 mode, ``"bf16-mixed"`` / ``"bf16-true"`` its
    bf16 mode (16-bit parameters and activations, fp32 masters), as DeepSpeed does. ``"-true"``
    additionally creates the module's tensors in the 16-bit dtype, so the fp32 masters then start from
    16-bit values. No autocast, no GradScaler: the engine casts and scales the loss itself.
    """

    precision: Any  # a PrecisionFlag; Any to agree with Lightning's own annotation of the attribute
    dtype: torch.dtype

    def _set_flag(self, precision: Any, owner: str) -> None:
        self.precision = check_precision_flag(precision, owner)
        self.dtype = PRECISION_DTYPE[self.precision]

    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.dtype) if self.precision.endswith("-true") else module

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype) if self.precision.endswith("-true") else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()


# ---------------------------------------------------------------------- the engine
def engine_config(
    raw_config: Mapping[str, Any],
    *,
    world_size: int,
    precision: str,
    micro_batch_size: int | None,
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    on_conflict: OnConflict,
) -> DeepSpeedConfig:
    """The raw config resolved with the face's values (see config.py)."""
    return resolve(
        raw_config,
        world_size=world_size,
        precision=precision,
        micro_batch_size=micro_batch_size,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_clip_val=gradient_clip_val,
        on_conflict=on_conflict,
    )


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


def build_engine(
    module: Module, config: DeepSpeedConfig, optimizer: Optimizer | None, device: torch.device
) -> ZeroEngine:
    from ds_strategy.runtime import ZeroEngine

    refuse_pipeline_module(module)
    # The stage-3 engine is selected by the config's stage inside ZeroEngine (runtime.zero.STAGES).
    return ZeroEngine(module, config, optimizer=optimizer, device=device)


def save_engine(
    engine: ZeroEngine,
    path: str | os.PathLike[str],
    client_state: Mapping[str, Any],
    *,
    exclude_frozen_parameters: bool = False,
    exclude_optimizer_states: bool = False,
) -> None:
    """Every rank writes its shards under ``path/<TAG>`` (engine format, docs/checkpointing.md)."""
    engine.save_checkpoint(
        path,
        tag=lckpt.TAG,
        client_state=lckpt.client_state(client_state),
        exclude_frozen_parameters=exclude_frozen_parameters,
        exclude_optimizer_states=exclude_optimizer_states,
    )


def load_engine(
    engine: ZeroEngine, path: str | os.PathLike[str], *, load_optimizer_states: bool, load_module_only: bool
) -> dict[str, Any]:
    """Load what ``save_engine`` wrote (at any world size and stage: the engine reshards); return the
    client state. ``path`` is the directory or the tag directory inside it."""
    load_dir, tag = lckpt.locate(path)
    _, state = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=False,  # schedulers belong to the Lightning side, restored from the state
        load_module_only=load_module_only,
    )
    return state


def is_engine_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory ``save_engine`` wrote (or its tag directory)."""
    root = Path(path)
    return (root / "latest").is_file() or (root / "meta.pt").is_file()


# ---------------------------------------------------------------------- collectives
def barrier(device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl" and device.type == "cuda":
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    # A fake group moves nothing: the other ranks' broadcast would leave this rank's list unsized garbage.
    if not _distributed_is_initialized() or is_fake_group():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]
