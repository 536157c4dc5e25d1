"""Typed, frozen config objects: what the rest of ds_strategy reads instead of raw dict keys.

Field names are the DeepSpeed JSON keys, so docs/config.md describes both. Field defaults mirror the
schema defaults (a test keeps them in sync); ``load_config`` always passes every value explicitly, the
defaults only serve direct construction (``ZeroConfig(stage=3)``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from .batch import BatchSizes, resolve_batch_sizes
from .checks import IMPLEMENTED_OPTIMIZERS, autotuning_problems, parse_memory_size
from .context import ConfigContext
from .errors import ConfigError, ConfigProblem, format_value
from .frozen import FrozenDict, freeze, thaw
from .schema import Schema, child_schema, coerce, load_schema, resolve, validate
from .support import classify

if TYPE_CHECKING:
    import torch

DType = Literal["fp16", "bf16", "fp32"]
OffloadDevice = Literal["none", "cpu", "nvme"]
TagValidation = Literal["Ignore", "Warn", "Fail"]
AUTO = "auto"

# The config objects ``ds_strategy.config`` re-exports (``from .model import *``).
__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "AutotuningConfig",
    "BF16Config",
    "CheckpointConfig",
    "CommsLoggerConfig",
    "CompileConfig",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "HybridEngineConfig",
    "LeafModuleConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "ZeroConfig",
]

# Fields that are ds_strategy bookkeeping rather than DeepSpeed JSON keys.
_NOT_JSON = {"json": False}


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer`` or ``zero_optimization.offload_param``.

    One class for both; keys that only exist for one kind keep their default on the other.
    ``buffer_count`` defaults to 4 for the optimizer and 5 for parameters (DeepSpeed's values).
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    ratio: float = 1.0
    fast_init: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("none", "cpu", "nvme"):
            raise ConfigError(
                [ConfigProblem("device", f'got {format_value(self.device)}; expected one of "none", "cpu", "nvme"')]
            )

    @property
    def enabled(self) -> bool:
        return self.device != "none"


# DeepSpeed's default ``leaf_module.classes`` (runtime/zero/leaf_module_config.py): transformers' sparse MoE blocks.
DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


@dataclass(frozen=True, kw_only=True)
class LeafModuleConfig:
    """``zero_optimization.leaf_module``: modules stage 3 gathers with their whole subtree as one unit (see
    [Note: leaf modules] in runtime/zero/leaf.py), chosen by class, by name and by name suffix."""

    classes: tuple[str, ...] = DEFAULT_LEAF_MODULE_CLASSES
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in ("classes", "names", "name_suffixes"):
            value = getattr(self, key)
            items = (value,) if isinstance(value, str) else tuple(value)  # DeepSpeed takes one string as a list
            object.__setattr__(self, key, tuple(dict.fromkeys(items)))  # and drops repeats


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """``zero_optimization``: which ZeRO stage and how it buckets, overlaps and offloads."""

    stage: int = 0
    contiguous_gradients: bool = True
    # None (the default) resolves to ``stage == 3`` in __post_init__, as in DeepSpeed's code.
    overlap_comm: bool = cast(bool, None)
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    round_robin_gradients: bool = False
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=lambda: OffloadConfig(buffer_count=5))
    sub_group_size: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_model_persistence_threshold: int = sys.maxsize
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    # Stage 3 fetch units (runtime/zero/units.py): "blocks", "modules" or class names.
    stage3_fetch_units: str | tuple[str, ...] = "blocks"
    # Large frozen Linear / Embedding weights computed tile by tile (runtime/zero/tiled.py).
    stage3_tile_frozen: bool = True
    stage3_gather_16bit_weights_on_model_save: bool = False
    load_from_fp32_weights: bool = True
    ignore_unused_parameters: bool = True
    # ZeRO++ (stage 3; runtime/zero/zeropp.py): quantized weight gathers (qwZ), int8 frozen partitions, the
    # secondary partition per node group (hpZ) and quantized gradient all-to-alls (qgZ).
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_gradients: bool = False
    leaf_module: LeafModuleConfig = field(default_factory=LeafModuleConfig)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3) or isinstance(self.stage, bool):
            raise ConfigError(
                [
                    ConfigProblem(
                        "zero_optimization.stage", f"got {format_value(self.stage)}; expected one of 0, 1, 2, 3"
                    )
                ]
            )
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)

    @property
    def enabled(self) -> bool:
        return self.stage > 0


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """``fp16``: mixed precision with (static or dynamic) loss scaling."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    @property
    def dynamic_loss_scale(self) -> bool:
        """``loss_scale == 0`` selects dynamic loss scaling."""
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        """The first loss scale: ``loss_scale`` if static, else ``2 ** initial_scale_power``."""
        return float(2**self.initial_scale_power) if self.dynamic_loss_scale else self.loss_scale


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """``bf16`` (old name ``bfloat16``): mixed precision without loss scaling."""

    enabled: bool = False


@dataclass(frozen=True, kw_only=True)
class _CallableConfig:
    type: str
    params: FrozenDict = field(default_factory=FrozenDict)

    def __post_init__(self) -> None:
        if not isinstance(self.params, FrozenDict):
            object.__setattr__(self, "params", freeze(self.params))

    @property
    def unresolved(self) -> tuple[str, ...]:
        """Names of params still set to "auto" (no context supplied them)."""
        return tuple(k for k, v in self.params.items() if v == AUTO)

    def kwargs(self) -> dict[str, Any]:
        """Params as constructor keyword arguments; raises if any is still "auto"."""
        section = "optimizer" if isinstance(self, OptimizerConfig) else "scheduler"
        if self.unresolved:
            raise ConfigError(
                [
                    ConfigProblem(
                        f"{section}.params.{name}",
                        f'is "auto" and nothing resolved it; give a value in the config or pass '
                        f"{section}_params={{{name!r}: ...}} in the context",
                    )
                    for name in self.unresolved
                ]
            )
        return {k: thaw(v) for k, v in self.params.items()}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_CallableConfig):
    """``optimizer``: canonical type name (``"AdamW"``) and its keyword arguments (frozen)."""

    @property
    def implemented(self) -> bool:
        """Whether ds_strategy can build this optimizer (the others need a client optimizer)."""
        return self.type in IMPLEMENTED_OPTIMIZERS


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(_CallableConfig):
    """``scheduler``: canonical type name (``"WarmupLR"``) and its keyword arguments, defaults filled."""


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


AIO_ALIGNMENT = 4096  # bytes: the O_DIRECT unit; ops/aio.py's ALIGNMENT (a test keeps the two equal)


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """``aio``: the asynchronous I/O engine of NVMe offload (``ds_strategy.ops.aio``).

    The one place the block is validated: positive integers, ``block_size`` a multiple of 4096 bytes (the
    O_DIRECT unit), true/false flags, ``use_gds`` refused, and DeepSpeed's newer name for ``thread_count``
    (``intra_op_parallelism``, which wins when set: ``threads``). ``ds_strategy.ops.aio.AioOptions`` takes
    these values as they are. ``AioConfig.from_block(dict)`` validates a block outside a whole config.
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    intra_op_parallelism: int | None = None  # DeepSpeed's newer name for thread_count: wins when set
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    def __post_init__(self) -> None:
        problems: list[ConfigProblem] = []
        counts = ["block_size", "queue_depth", "thread_count"]
        if self.intra_op_parallelism is not None:
            counts.append("intra_op_parallelism")
        for key in counts:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(ConfigProblem(f"aio.{key}", f"got {format_value(value)}; expected a positive integer"))
            elif key == "block_size" and value % AIO_ALIGNMENT:
                multiple = -(-value // AIO_ALIGNMENT) * AIO_ALIGNMENT
                problems.append(
                    ConfigProblem(
                        "aio.block_size",
                        f"got {value}; expected a multiple of {AIO_ALIGNMENT} bytes (the O_DIRECT unit), "
                        f"for example {multiple}",
                    )
                )
        for key in ("single_submit", "overlap_events", "use_gds"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                problems.append(ConfigProblem(f"aio.{key}", f"got {format_value(value)}; expected true or false"))
        if self.use_gds is True:
            problems.append(ConfigProblem("aio.use_gds", "GPUDirect Storage is not supported; set it to false"))
        if problems:
            raise ConfigError(problems)

    @property
    def threads(self) -> int:
        return self.intra_op_parallelism or self.thread_count

    @classmethod
    def from_block(cls, block: Mapping[str, Any] | None) -> AioConfig:
        """The ``aio`` block of a DeepSpeed config (a dict with DeepSpeed's keys, or None for every default),
        validated, for code that drives ``ds_strategy.ops.aio`` without a whole config; a whole config
        validates its block in ``load_config``. Raises ``ConfigError`` naming each ``aio.<key>`` at fault."""
        block = dict(block or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in block if key not in names]
        if unknown:
            valid = ", ".join(sorted(names))
            raise ConfigError([ConfigProblem(f"aio.{key}", f"unknown key; valid keys are {valid}") for key in unknown])
        return cls(**block)


TunerType = Literal["gridsearch", "random", "model_based"]
Metric = Literal["throughput", "latency", "flops"]


@dataclass(frozen=True, kw_only=True)
class AutotuningConfig:
    """``autotuning``: what ``ds_strategy.autotune`` (and ``ds-launch --autotuning``) reads.

    DeepSpeed's keys with DeepSpeed's defaults, plus ``max_memory_per_rank`` (a cap a trial must stay under:
    bytes, a size with a unit such as ``"16GB"`` / ``"512MiB"``, or ``"auto"``: see ``memory_cap``) and
    ``time_budget_s`` (no trial starts after it) and ``confirm_top`` (the best fitted trials run once more,
    ranked by both runs). DeepSpeed's keys that make no sense in-process
    (``arg_mappings``, ``model_info``, ``model_info_path``, ``metric_path``, an ``mp_size`` above 1, the
    metrics ``"forward"`` / ``"step"``) are refused with the reason (config/support.py, config/checks.py).
    A direct construction is validated as ``load_config`` validates the block (``tuner_type="grid"`` is
    ``"gridsearch"``); ``AutotuningConfig.from_block(dict)`` validates a block outside a whole config.
    """

    enabled: bool = False
    metric: Metric = "throughput"
    start_profile_step: int = 3
    end_profile_step: int = 5
    fast: bool = True
    max_train_batch_size: int | None = None
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    tuner_type: TunerType = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    mp_size: int = 1
    max_memory_per_rank: int | str | None = None
    time_budget_s: float | None = None
    confirm_top: int = 2

    def __post_init__(self) -> None:
        schema = load_schema()
        block = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        root = coerce({"autotuning": block}, schema)  # tolerated spellings and aliases ("grid"), in place
        problems = validate(root) or autotuning_problems(block) + classify(root, schema)[0]
        if problems:
            raise ConfigError(problems)
        budget = block["time_budget_s"]
        if isinstance(budget, int):
            block["time_budget_s"] = float(budget)
        for name, value in block.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_block(cls, block: Mapping[str, Any] | None) -> AutotuningConfig:
        """The ``autotuning`` block of a DeepSpeed config (a dict with DeepSpeed's keys, or None for every
        default), validated; a whole config validates its block in ``load_config``. Raises ``ConfigError``
        naming each ``autotuning.<key>`` at fault (DeepSpeed's refused keys included)."""
        block = dict(block or {})
        schema = load_schema()
        names = {f.name for f in dataclasses.fields(cls)}
        root = coerce({"autotuning": dict(block)}, schema)
        problems = validate(root) or autotuning_problems(root["autotuning"]) + classify(root, schema)[0]
        if problems:
            raise ConfigError(problems)
        return cls(**{k: v for k, v in root["autotuning"].items() if k in names})

    def memory_cap(self, device: torch.device | str) -> int | None:
        """``max_memory_per_rank`` in bytes on ``device``, or None without a cap. ``"auto"`` is the free memory
        of the device now: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of /proc/meminfo on the CPU
        (None where neither can be read, as on another device kind)."""
        cap = self.max_memory_per_rank
        if cap is None:
            return None
        if not (isinstance(cap, str) and cap.strip().lower() == AUTO):
            return parse_memory_size(cap)
        import torch

        where = torch.device(device)
        if where.type == "cuda":
            return int(torch.cuda.mem_get_info(where)[0])
        return _mem_available() if where.type == "cpu" else None


def _mem_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), None off Linux."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    return None


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig:
    """``comms_logger``."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig:
    """``flops_profiler``."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """``checkpoint``."""

    tag_validation: TagValidation = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False

    @property
    def tag_validation_enabled(self) -> bool:
        return self.tag_validation != "Ignore"

    @property
    def tag_validation_fail(self) -> bool:
        return self.tag_validation == "Fail"


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """``pipeline``: read by the PipelineEngine (runtime/pipe, docs/pipeline.md)."""

    stages: int | str = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = 0
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True


@dataclass(frozen=True, kw_only=True)
class HybridEngineConfig:
    """``hybrid_engine``: training and generation in one engine (runtime/hybrid.py, docs/hybrid_engine.md)."""

    enabled: bool = False
    max_out_tokens: int = 512
    inference_tp_size: int = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = 8
    enable_cuda_graph: bool = False


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """``compile``: torch.compile through the engine (runtime/compile.py, docs/compile.md)."""

    enabled: bool = False
    backend: str = "inductor"
    kwargs: FrozenDict = field(default_factory=FrozenDict)


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    """``data_types``."""

    grad_accum_dtype: DType | None = None


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig:
    """A validated DeepSpeed config with "auto" values resolved. Build it with ``load_config``.

    The batch triple is None until it can be resolved (it needs a world size and a micro batch size or
    train_batch_size); ``batch`` raises a ``ConfigError`` that says what is missing.
    """

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    world_size: int | None = field(default=None, metadata=_NOT_JSON)  # data-parallel: ranks / sequence_parallel_size
    sequence_parallel_size: int = 1
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    gradient_clipping: float = 1.0  # DeepSpeed's default (runtime/constants.py GRADIENT_CLIPPING_DEFAULT)
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    communication_data_type: DType | None = None
    seq_parallel_comm_data_type: DType = "fp32"
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    autotuning: AutotuningConfig = field(default_factory=AutotuningConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    # Accepted-but-ignored DeepSpeed settings by dotted path, kept so ``to_dict`` round-trips.
    ignored: FrozenDict = field(default_factory=FrozenDict, metadata=_NOT_JSON)
    # The validated input before "auto" resolution, and the context used: what re-resolution starts from.
    input_config: FrozenDict | None = field(default=None, repr=False, compare=False, metadata=_NOT_JSON)
    context: ConfigContext | None = field(default=None, repr=False, compare=False, metadata=_NOT_JSON)

    def __post_init__(self) -> None:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                [ConfigProblem("bf16.enabled", "fp16.enabled and bf16.enabled are both true; enable at most one")]
            )
        triple = (self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps)
        if self.world_size is not None and None not in triple:
            resolve_batch_sizes(*triple, self.world_size)

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization.stage > 0

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def fp16_enabled(self) -> bool:
        return self.fp16.enabled

    @property
    def bf16_enabled(self) -> bool:
        return self.bf16.enabled

    @property
    def precision_dtype(self) -> torch.dtype:
        """torch.float16, torch.bfloat16 or torch.float32 (imports torch on first use)."""
        import torch

        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def batch_resolved(self) -> bool:
        return None not in (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )

    @property
    def batch(self) -> BatchSizes:
        """The resolved batch triple; raises ``ConfigError`` saying what is missing when unresolved."""
        tb, mb, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if tb is None or mb is None or gas is None or self.world_size is None:
            if self.world_size is None:
                missing = "the data-parallel world size is needed; pass it with load_config(..., world_size=...)"
            else:
                missing = (
                    "a micro batch size is needed: set train_micro_batch_size_per_gpu (or train_batch_size) in the "
                    "config, or pass it with load_config(..., context=ConfigContext(micro_batch_size=...))"
                )
            raise ConfigError(
                [
                    ConfigProblem(
                        "train_batch_size",
                        f"the batch sizes are not resolved yet (train_batch_size={format_value(tb)}, "
                        f"train_micro_batch_size_per_gpu={format_value(mb)}, gradient_accumulation_steps="
                        f"{format_value(gas)}): {missing}",
                    )
                ]
            )
        return BatchSizes(
            train_batch_size=tb,
            train_micro_batch_size_per_gpu=mb,
            gradient_accumulation_steps=gas,
            world_size=self.world_size,
        )

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as DeepSpeed JSON (ignored settings included), e.g. for checkpoints."""
        out = _to_json(self, load_schema())
        assert isinstance(out, dict)
        for path, value in self.ignored.items():
            *parents, leaf = path.split(".")
            target = out
            for part in parents:
                target = target.setdefault(part, {})
            target[leaf] = thaw(value)
        return out


def _to_json(value: Any, node: Schema) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        node = resolve(node)
        known = node.get("properties", {})
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.metadata.get("json", True) is False or f.name not in known:
                continue
            if item is None and f.name in (
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "optimizer",
                "scheduler",
            ):
                continue
            child = child_schema(node, f.name, out) or {}
            out[f.name] = _to_json(item, child)
        return out
    return thaw(value)
