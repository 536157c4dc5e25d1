"""Cross-field rules the schema cannot express, plus the advisory warnings about a config.

Runs on the resolved, default-filled dict, defensively: values of the wrong type were already reported
by the schema, so a rule whose inputs are malformed is skipped rather than reported twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeGuard

from .errors import ConfigProblem, format_value
from .schema import Schema, child_schema, resolve

IMPLEMENTED_OPTIMIZERS = ("Adam", "AdamW", "Adagrad", "Lion", "SGD", "Muon", "Adafactor")


def _section(parent: Any, key: str) -> dict[str, Any]:
    value = parent.get(key) if isinstance(parent, dict) else None
    return value if isinstance(value, dict) else {}


def cross_checks(config: dict[str, Any]) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    if _section(config, "fp16").get("enabled") is True and _section(config, "bf16").get("enabled") is True:
        problems.append(
            ConfigProblem("bf16.enabled", "fp16.enabled and bf16.enabled are both true; enable at most one")
        )

    fp16 = _section(config, "fp16")
    if fp16.get("auto_cast") is True and fp16.get("enabled") is False:
        problems.append(
            ConfigProblem(
                "fp16.auto_cast",
                "casts the forward's floating inputs to fp16, but fp16.enabled is false (the model is not fp16); "
                "enable fp16 or remove auto_cast",
            )
        )

    zero = _section(config, "zero_optimization")
    stage = zero.get("stage") if zero.get("stage") in (0, 1, 2, 3) else None
    param = _section(zero, "offload_param")
    optim = _section(zero, "offload_optimizer")
    param_device, optim_device = param.get("device"), optim.get("device")
    if stage is not None and param_device in ("cpu", "nvme") and stage != 3:
        problems.append(
            ConfigProblem(
                "zero_optimization.offload_param.device",
                f"parameter offload ({format_value(param_device)}) needs ZeRO stage 3, but zero_optimization.stage is "
                f"{stage}; use offload_optimizer for stages 1-2",
            )
        )
    if stage == 0 and optim_device in ("cpu", "nvme"):
        problems.append(
            ConfigProblem(
                "zero_optimization.offload_optimizer.device",
                f"optimizer offload ({format_value(optim_device)}) needs ZeRO stage 1, 2 or 3, but "
                "zero_optimization.stage is 0",
            )
        )
    for kind, block in (("offload_optimizer", optim), ("offload_param", param)):
        if block.get("device") != "nvme":
            continue
        path = block.get("nvme_path")
        if not isinstance(path, str) or not path:
            problems.append(
                ConfigProblem(
                    f"zero_optimization.{kind}.nvme_path",
                    f'{kind}.device is "nvme" but nvme_path is {format_value(path)}; set it to a directory on a '
                    "fast local disk (its swap files go there)",
                )
            )
        count, default = block.get("buffer_count"), 4 if kind == "offload_optimizer" else 5
        if isinstance(count, int) and count < 1:
            problems.append(
                ConfigProblem(
                    f"zero_optimization.{kind}.buffer_count",
                    f"got {count}; NVMe offload needs at least 1 buffer (DeepSpeed's default: {default})",
                )
            )
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        if stage is not None and stage != 3 and zero.get(key) is True:
            problems.append(
                ConfigProblem(
                    f"zero_optimization.{key}",
                    f"ZeRO++ needs ZeRO stage 3, but zero_optimization.stage is {stage}; set stage 3 or remove the key",
                )
            )
    hpz = zero.get("zero_hpz_partition_size")
    if stage is not None and stage != 3 and isinstance(hpz, int) and hpz > 1:
        problems.append(
            ConfigProblem(
                "zero_optimization.zero_hpz_partition_size",
                f"got {hpz}; hpZ (a secondary partition per node group) needs ZeRO stage 3, but "
                f"zero_optimization.stage is {stage}; set stage 3 or use 1",
            )
        )
    # A partial optimizer offload (ratio < 1: runtime/zero/partial_offload.py) splits host and compute-device masters.
    ratio = optim.get("ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio < 1:
        if optim_device == "nvme":
            problems.append(
                ConfigProblem(
                    "zero_optimization.offload_optimizer.ratio",
                    f'got {ratio} with offload_optimizer.device "nvme"; a partial offload to NVMe is not built (the '
                    'swapped part would have to be split from the device part); use device "cpu" with a ratio, or '
                    "NVMe with ratio 1",
                )
            )
        if param_device in ("cpu", "nvme"):
            problems.append(
                ConfigProblem(
                    "zero_optimization.offload_optimizer.ratio",
                    f"got {ratio} with offload_param.device {format_value(param_device)}; a partial optimizer offload "
                    "keeps part of the masters on the compute device, where parameter offload keeps no parameters "
                    "to update; use ratio 1 with offload_param, or keep the parameters on the device",
                )
            )
    problems += autotuning_problems(_section(config, "autotuning"))
    return problems


# ``autotuning.metric`` values of DeepSpeed's that rank nothing a whole training step is made of.
REFUSED_METRICS = ("forward", "step", "steps")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_memory_size(value: int | str) -> int:
    """Bytes of a memory size: an integer, or a string with a unit (``"16GB"`` = 16 x 10^9, ``"512MiB"`` =
    512 x 2^20, ``"1.5 GiB"``, ``"4096"`` or ``"4096B"``). Raises ``ValueError`` for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None or (m.group(2) and not m.group(4)) or (m.group(3) and not m.group(2)):
        raise ValueError(f"not a memory size: {value!r}")
    number, prefix, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = "kmgt".index(prefix) + 1 if prefix else 0
    return int(number * (1024 if binary else 1000) ** power)


def autotuning_problems(block: Mapping[str, Any]) -> list[ConfigProblem]:
    """The ``autotuning`` rules the schema cannot express: the profile steps in order, the micro-batch
    range, DeepSpeed's metrics that are refused and ``max_memory_per_rank``'s spelling."""
    problems: list[ConfigProblem] = []
    metric = block.get("metric")
    if metric in REFUSED_METRICS:
        problems.append(
            ConfigProblem(
                "autotuning.metric",
                f"{format_value(metric)} is not supported by ds_strategy: trials are ranked by whole training "
                'steps (forward, backward and optimizer step); use "throughput" (samples/s), "latency" '
                '(seconds per step) or "flops" (FLOPS per rank)',
            )
        )
    start, end = block.get("start_profile_step"), block.get("end_profile_step")
    if _is_int(start) and _is_int(end) and end <= start:
        problems.append(
            ConfigProblem(
                "autotuning.end_profile_step",
                f"got {end}, which is not after start_profile_step ({start}); a trial times the steps from "
                "start_profile_step to end_profile_step, so use an end_profile_step above start_profile_step",
            )
        )
    low, high = block.get("min_train_micro_batch_size_per_gpu"), block.get("max_train_micro_batch_size_per_gpu")
    if _is_int(low) and _is_int(high) and low > high:
        problems.append(
            ConfigProblem(
                "autotuning.min_train_micro_batch_size_per_gpu",
                f"got {low}, above max_train_micro_batch_size_per_gpu ({high}); no micro batch would be tried, "
                "lower the minimum or raise the maximum",
            )
        )
    cap = block.get("max_memory_per_rank")
    if isinstance(cap, str) and cap.strip().lower() != "auto":
        try:
            size = parse_memory_size(cap)
        except ValueError:
            size = 0
        if size <= 0:
            problems.append(
                ConfigProblem(
                    "autotuning.max_memory_per_rank",
                    f"got {format_value(cap)}; expected a number of bytes, a positive size with a unit such as "
                    '"16GB" (10^9) or "512MiB" (2^20), "auto" (the device\'s free memory) or null (no cap)',
                )
            )
    return problems


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def advisories(config: dict[str, Any]) -> list[str]:
    """Loadable but worth a warning: optimizer types ds_strategy cannot build, clipping in the wrong place."""
    notes: list[str] = []
    optimizer = _section(config, "optimizer")
    kind = optimizer.get("type")
    if isinstance(kind, str) and kind not in IMPLEMENTED_OPTIMIZERS:
        notes.append(
            f"optimizer.type {kind!r} is a DeepSpeed optimizer that ds_strategy does not implement; pass your own "
            f"optimizer (Lightning: configure_optimizers; initialize(optimizer=...)) or use one of "
            f"{', '.join(IMPLEMENTED_OPTIMIZERS)}"
        )
    offload = _section(_section(config, "zero_optimization"), "offload_optimizer")
    ratio, device = offload.get("ratio"), offload.get("device", "none")
    if _is_number(ratio) and ratio != 1 and device not in ("cpu", "nvme"):
        notes.append(
            f"zero_optimization.offload_optimizer.ratio {ratio} does nothing: offload_optimizer.device is "
            f'{format_value(device)}, so nothing is offloaded; set device "cpu" for a partial offload, or remove ratio'
        )
    return notes


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def split_ignored(config: dict[str, Any], node: Schema, path: str = "") -> dict[str, tuple[Any, bool]]:
    """Remove ``x-ignored`` keys from ``config`` (in place); return path -> (value, active).

    ``active`` means the value asks for something: it differs from the schema default and is not a
    disabled section (``{"enabled": false}``). Only active ones deserve a warning.
    """
    node = resolve(node)
    out: dict[str, tuple[Any, bool]] = {}
    for key in list(config):
        child = child_schema(node, key, config)
        if child is None:
            continue
        full = f"{path}.{key}" if path else key
        value = config[key]
        if child.get("x-ignored"):
            out[full] = (config.pop(key), _is_active(value, child))
        elif isinstance(value, dict) and full not in ("optimizer.params", "scheduler.params"):
            out.update(split_ignored(value, child, full))
    return out


def _is_active(value: Any, node: Mapping[str, Any]) -> bool:
    if "default" in node and value == node["default"]:
        return False
    return _asks_for_something(value)


def _asks_for_something(value: Any) -> bool:
    if isinstance(value, dict):
        if "enabled" in value:
            return value["enabled"] not in (False, None, "false", "False")
        return any(_asks_for_something(v) for v in value.values())
    return value not in (None, False, "", []) and value != "false"
