"""Structural legacy forms DeepSpeed still accepts, rewritten to the current form before validation.

Scalar spellings (``"true"``, ``3e8``, enum case) are handled by ``schema.coerce``; this module only
moves and renames keys. Each rewrite is reported as a ``ConfigDeprecationWarning`` naming the modern
spelling; a config that gives both the old and the new spelling with different values is a problem,
never a silent choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigProblem, format_value, join_path


@dataclass(frozen=True)
class LegacyForm:
    """One tolerated legacy spelling; the docs table is generated from ``LEGACY_FORMS``."""

    old: str
    new: str


LEGACY_FORMS: tuple[LegacyForm, ...] = (
    LegacyForm('"zero_optimization": true', '"zero_optimization": {"stage": 1} (false: stage 0)'),
    LegacyForm('"allgather_size": N (with "zero_optimization": true)', "zero_optimization.allgather_bucket_size"),
    LegacyForm('"bfloat16": {...}', '"bf16": {...}'),
    LegacyForm(
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    LegacyForm("zero_optimization.cpu_offload: true", 'zero_optimization.offload_optimizer: {"device": "cpu"}'),
    LegacyForm("zero_optimization.cpu_offload_param: true", 'zero_optimization.offload_param: {"device": "cpu"}'),
    LegacyForm(
        "zero_optimization.cpu_offload_use_pin_memory: true", "pin_memory: true in the offload sections it created"
    ),
    LegacyForm("seq_parallel_communication_data_type", "seq_parallel_comm_data_type"),
    LegacyForm('"true" / "false" strings, 0 / 1 for booleans', "true / false"),
    LegacyForm("integral floats such as 3e8 for integers", "300000000"),
    LegacyForm('enum names in any case ("adamw", "warn")', '"AdamW", "Warn"'),
)


@dataclass
class Normalized:
    config: dict[str, Any]
    problems: list[ConfigProblem]
    deprecations: list[str]


def to_json_like(value: Any, path: str, problems: list[ConfigProblem]) -> Any:
    """Deep copy into plain dict/list so later stages may edit freely (the caller's dict is untouched)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(ConfigProblem(path, f"keys must be strings, got {key!r}"))
                continue
            out[key] = to_json_like(item, join_path(path, key), problems)
        return out
    if isinstance(value, (list, tuple)):
        return [to_json_like(item, join_path(path, i), problems) for i, item in enumerate(value)]
    return value


def normalize(raw: Mapping[str, Any]) -> Normalized:
    problems: list[ConfigProblem] = []
    config = to_json_like(raw, "", problems)
    result = Normalized(config, problems, [])
    _zero_optimization_bool(result)
    _rename(result, config, "", "bfloat16", "bf16")
    _rename(result, config, "", "seq_parallel_communication_data_type", "seq_parallel_comm_data_type")
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _rename(
            result,
            zero,
            "zero_optimization",
            "stage3_gather_fp16_weights_on_model_save",
            "stage3_gather_16bit_weights_on_model_save",
        )
        _cpu_offload_flags(result, zero)
    return result


def _zero_optimization_bool(result: Normalized) -> None:
    config = result.config
    zero = config.get("zero_optimization")
    if not isinstance(zero, bool):
        return
    stage = 1 if zero else 0
    section: dict[str, Any] = {"stage": stage}
    if "allgather_size" in config:
        size = config.pop("allgather_size")
        if zero:
            section["allgather_bucket_size"] = size
    config["zero_optimization"] = section
    result.deprecations.append(
        f'"zero_optimization": {format_value(zero)} is a legacy form; write "zero_optimization": {{"stage": {stage}}}'
    )


def _rename(result: Normalized, section: dict[str, Any], path: str, old: str, new: str) -> None:
    if old not in section:
        return
    value = section.pop(old)
    if new in section and section[new] != value:
        result.problems.append(
            ConfigProblem(
                join_path(path, old),
                f"legacy name of {join_path(path, new)}, which is also given with a different value "
                f"({format_value(value)} vs {format_value(section[new])}); keep only {new}",
            )
        )
        return
    section[new] = value
    result.deprecations.append(f"{join_path(path, old)} is a legacy name; write {join_path(path, new)}")


def _cpu_offload_flags(result: Normalized, zero: dict[str, Any]) -> None:
    created: list[str] = []
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        flag = zero.pop(old)
        path = join_path("zero_optimization", old)
        if isinstance(flag, str) and flag.strip().lower() in ("true", "false"):
            flag = flag.strip().lower() == "true"
        if not isinstance(flag, bool):
            result.problems.append(ConfigProblem(path, f"got {format_value(flag)}; expected a boolean"))
            continue
        result.deprecations.append(f'{path} is deprecated; write zero_optimization.{new}: {{"device": "cpu"}}')
        if not flag:
            continue
        if new in zero:
            # DeepSpeed refuses the deprecated flag next to its replacement too.
            result.problems.append(
                ConfigProblem(path, f"legacy form of zero_optimization.{new}, which is also given; keep only {new}")
            )
            continue
        zero[new] = {"device": "cpu"}
        created.append(new)
    if "cpu_offload_use_pin_memory" in zero:
        pin = zero.pop("cpu_offload_use_pin_memory")
        path = "zero_optimization.cpu_offload_use_pin_memory"
        if isinstance(pin, str) and pin.strip().lower() in ("true", "false"):
            pin = pin.strip().lower() == "true"
        if not isinstance(pin, bool):
            result.problems.append(ConfigProblem(path, f"got {format_value(pin)}; expected a boolean"))
            return
        for new in created:
            zero[new]["pin_memory"] = pin
        target = " and ".join(f"zero_optimization.{n}.pin_memory" for n in created) or "pin_memory in offload_*"
        result.deprecations.append(f"{path} is deprecated; write {target}")
