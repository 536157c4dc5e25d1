"""``load_config``: the one place a raw DeepSpeed config dict is read.

Pipeline: read (dict, JSON file, JSON text) -> rewrite legacy forms -> coerce tolerated scalars ->
validate against the schema -> resolve "auto" and the batch triple -> fill defaults -> cross-field
checks -> raise every problem at once, or build the frozen ``DeepSpeedConfig`` and emit the warnings.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from .auto import Resolution, resolve_auto
from .checks import advisories, cross_checks, split_ignored
from .context import ConfigContext, as_context
from .errors import (
    ConfigConflictWarning,
    ConfigDeprecationWarning,
    ConfigError,
    ConfigProblem,
    ConfigWarning,
    IgnoredConfigWarning,
)
from .frozen import FrozenDict, freeze, thaw
from .model import (
    ActivationCheckpointingConfig,
    AioConfig,
    AutotuningConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    CompileConfig,
    DataTypesConfig,
    DeepSpeedConfig,
    FlopsProfilerConfig,
    FP16Config,
    HybridEngineConfig,
    LeafModuleConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    ZeroConfig,
)
from .normalize import normalize
from .schema import coerce, fill_defaults, load_schema, validate
from .support import classify

T = TypeVar("T")

ConfigInput = DeepSpeedConfig | Mapping[str, Any] | str | os.PathLike[str]


def load_config(
    config: ConfigInput,
    *,
    world_size: int | None = None,
    context: ConfigContext | Mapping[str, Any] | None = None,
) -> DeepSpeedConfig:
    """Validate a DeepSpeed config once and return it typed and frozen.

    ``config`` is a dict, a path to a JSON file, a JSON object as text, or a ``DeepSpeedConfig``
    (returned as is, or re-resolved from its original input when ``world_size`` / ``context`` are
    given). ``world_size`` is the number of ranks training together; the batch arithmetic uses their
    data-parallel size, ``world_size / sequence_parallel_size`` (``config.world_size``); ``context``
    (a ``ConfigContext`` or a mapping of its fields) supplies values for "auto" entries.

    Raises ``ConfigError`` listing every problem found. Emits ``ConfigDeprecationWarning`` for legacy
    forms, ``IgnoredConfigWarning`` for accepted-but-ignored settings and ``ConfigConflictWarning`` when
    ``context.on_conflict`` picked a winner.
    """
    ctx = as_context(context)
    if isinstance(config, DeepSpeedConfig):
        if world_size is None and ctx is None:
            return config
        raw = thaw(config.input_config) if config.input_config is not None else config.to_dict()
        if ctx is None and config.context is not None:
            # Reuse the earlier context; a newly given world size replaces the one it carried.
            ctx = config.context if world_size is None else dataclasses.replace(config.context, world_size=None)
        if world_size is None and (ctx is None or ctx.world_size is None) and config.world_size is not None:
            world_size = config.world_size * config.sequence_parallel_size  # the ranks it was resolved for
        # Re-resolution: the first load already warned about the ignored settings.
        return _load(raw, world_size=world_size, context=ctx, source=None, warn_ignored=False)
    raw, source = _read(config)
    return _load(raw, world_size=world_size, context=ctx, source=source)


def find_problems(
    config: ConfigInput,
    *,
    world_size: int | None = None,
    context: ConfigContext | Mapping[str, Any] | None = None,
) -> list[ConfigProblem]:
    """Every problem ``load_config`` would raise for these arguments (empty when the config is valid).

    For linting tools: nothing is raised and no warning is emitted.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        try:
            load_config(config, world_size=world_size, context=context)
        except ConfigError as exc:
            return list(exc.problems)
    return []


def check_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> None:
    """Raise ``ConfigError`` for every problem that does not depend on the run (unknown keys, wrong types
    or values, refused settings, legacy-form clashes, cross-field rules such as a missing nvme_path): what a
    launcher checks before starting any process.
    "auto" entries and the batch arithmetic wait for ``load_config`` with the run's context. Warns nothing."""
    raw, source = _read(config)
    if not isinstance(raw, Mapping):
        raise ConfigError([ConfigProblem("", f"expected a JSON object, got {type(raw).__name__}")], source=source)
    schema = load_schema()
    norm = normalize(raw)
    validated = coerce(norm.config, schema)
    problems = list(norm.problems) + validate(validated)
    if not problems:
        problems += classify(fill_defaults(validated, schema), schema)[0] + cross_checks(dict(validated))
    if problems:
        raise ConfigError(_unique(problems), source=source)


def _read(config: Any) -> tuple[Any, str | None]:
    if isinstance(config, Mapping):
        return config, None
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return _parse_json(config, "JSON text"), "JSON text"
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                [ConfigProblem("", f"cannot read config file {str(path)!r}: {exc.strerror or exc}")], source=str(path)
            ) from exc
        return _parse_json(text, str(path)), str(path)
    raise TypeError(
        f"config must be a dict, a path to a JSON file, JSON text or a DeepSpeedConfig, got {type(config).__name__}"
    )


def _parse_json(text: str, source: str) -> Any:
    duplicates: list[str] = []

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # DeepSpeed rejects duplicate keys too: json.loads would silently keep the last one.
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                duplicates.append(key)
            out[key] = value
        return out

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [ConfigProblem("", f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")], source=source
        ) from exc
    if duplicates:
        raise ConfigError(
            [
                ConfigProblem("", f"duplicate key {key!r}; JSON keeps only the last one, remove the others")
                for key in duplicates
            ],
            source=source,
        )
    return data


def _load(
    raw: Any,
    *,
    world_size: int | None,
    context: ConfigContext | None,
    source: str | None,
    warn_ignored: bool = True,
) -> DeepSpeedConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError([ConfigProblem("", f"expected a JSON object, got {type(raw).__name__}")], source=source)
    schema = load_schema()
    norm = normalize(raw)
    problems = list(norm.problems)
    validated = coerce(norm.config, schema)
    problems += validate(validated)
    res = resolve_auto(validated, context, world_size)
    problems += res.problems
    resolved = fill_defaults(res.config, schema)
    problems += cross_checks(resolved)
    refusals, ignored_notes = classify(resolved, schema)
    problems += refusals
    if problems:
        raise ConfigError(_unique(problems), source=source)

    notes: list[tuple[type[ConfigWarning], str]] = [(ConfigDeprecationWarning, d) for d in norm.deprecations]
    notes += [(ConfigConflictWarning, c) for c in res.conflicts]
    notes += [(ConfigWarning, a) for a in advisories(resolved)]
    if warn_ignored and _is_rank_zero():
        notes += [(IgnoredConfigWarning, n) for n in ignored_notes]
    ignored = split_ignored(resolved, schema)
    built = _build(
        resolved,
        res,
        ignored=FrozenDict({path: freeze(value) for path, (value, _) in ignored.items()}),
        input_config=freeze(copy.deepcopy(validated)),
        context=context,
    )
    for category, message in notes:
        warnings.warn(message, category, stacklevel=3)
    return built


def _is_rank_zero() -> bool:
    """Whether this process is rank 0: the ignored-setting warnings are printed once per job, not per rank.

    Asks torch.distributed only when something already imported it (the config layer does not import
    torch), else the launcher's RANK variable; a single process is rank 0.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return bool(dist.get_rank() == 0)
    return os.environ.get("RANK", "0") == "0"


def _unique(problems: list[ConfigProblem]) -> list[ConfigProblem]:
    out: list[ConfigProblem] = []
    for problem in problems:
        if problem not in out:
            out.append(problem)
    return out


def _make(cls: type[T], data: Mapping[str, Any], **overrides: Any) -> T:
    """Construct a config dataclass from its (validated, default-filled) JSON section."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif f.name in data:
            value = data[f.name]
            # JSON writes 1 for 1.0; keep float fields float.
            if f.type in ("float", "float | None") and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def _build(
    cfg: dict[str, Any],
    res: Resolution,
    *,
    ignored: FrozenDict,
    input_config: Any,
    context: ConfigContext | None,
) -> DeepSpeedConfig:
    zero = cfg["zero_optimization"]
    optimizer = cfg.get("optimizer")
    scheduler = cfg.get("scheduler")
    batch = res.batch
    tb, mb, gas = (
        (batch.train_batch_size, batch.train_micro_batch_size_per_gpu, batch.gradient_accumulation_steps)
        if batch is not None
        else res.partial_batch
    )
    return _make(
        DeepSpeedConfig,
        cfg,
        train_batch_size=tb,
        train_micro_batch_size_per_gpu=mb,
        gradient_accumulation_steps=gas,
        world_size=res.world_size,
        data_types=_make(DataTypesConfig, cfg["data_types"]),
        optimizer=None if optimizer is None else _make(OptimizerConfig, optimizer, params=freeze(optimizer["params"])),
        scheduler=None if scheduler is None else _make(SchedulerConfig, scheduler, params=freeze(scheduler["params"])),
        fp16=_make(FP16Config, cfg["fp16"]),
        bf16=_make(BF16Config, cfg["bf16"]),
        zero_optimization=_make(
            ZeroConfig,
            zero,
            offload_optimizer=_make(OffloadConfig, zero["offload_optimizer"]),
            offload_param=_make(OffloadConfig, zero["offload_param"]),
            leaf_module=_make(LeafModuleConfig, zero["leaf_module"]),
        ),
        activation_checkpointing=_make(ActivationCheckpointingConfig, cfg["activation_checkpointing"]),
        comms_logger=_make(CommsLoggerConfig, cfg["comms_logger"], prof_ops=tuple(cfg["comms_logger"]["prof_ops"])),
        flops_profiler=_make(FlopsProfilerConfig, cfg["flops_profiler"]),
        aio=_make(AioConfig, cfg["aio"]),
        autotuning=_make(AutotuningConfig, cfg["autotuning"]),
        checkpoint=_make(CheckpointConfig, cfg["checkpoint"]),
        hybrid_engine=_make(HybridEngineConfig, cfg["hybrid_engine"]),
        pipeline=_make(PipelineConfig, cfg["pipeline"]),
        compile=_make(CompileConfig, cfg["compile"], kwargs=freeze(cfg["compile"]["kwargs"])),
        ignored=ignored,
        input_config=input_config,
        context=context,
    )
