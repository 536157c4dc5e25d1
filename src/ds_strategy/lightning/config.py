"""The engine config of a ``ZeroStrategy``: the user's DeepSpeed config, the strategy's keywords, the Trainer.

Three sources, one rule: nothing is overridden silently.

1. ``config`` (a dict or a JSON path) is read as is.
2. The strategy's keywords (``stage``, ``offload_optimizer`` ...) are written into it; a keyword that
   contradicts a value the config states is a ``ValueError`` naming both (``apply_keywords``).
3. The Trainer fills what the config leaves absent or ``"auto"`` through a ``ConfigContext``: micro batch
   (from the train dataloader), ``accumulate_grad_batches``, ``gradient_clip_val`` and ``precision``; a
   Trainer value that contradicts the config is a ``ConfigError`` from ``load_config`` naming both.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from ds_strategy.config import ConfigContext, DeepSpeedConfig, OnConflict, check_config, load_config

from .compile import CompileArg, apply_compile

ConfigArg = str | Path | dict[str, Any] | None
DEFAULT_STAGE = 2


@dataclass(frozen=True)
class StrategyKeywords:
    """The typed keywords of ``ZeroStrategy`` that land in the config (None: not given)."""

    stage: int | None = None
    offload_optimizer: bool | None = None
    offload_parameters: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    loss_scale: float | None = None
    initial_scale_power: int | None = None
    micro_batch_size: int | None = None
    offload_optimizer_device: str | None = None  # Lightning DeepSpeedStrategy's names: "cpu" or "nvme"
    offload_params_device: str | None = None
    nvme_path: str | None = None
    sequence_parallel_size: int | None = None

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> StrategyKeywords:
        """The keywords out of a strategy constructor's arguments (its ``locals()``): both faces take the
        same names, so the list lives here once."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})


StartMethod = Literal["auto", "popen", "fork", "spawn"]
START_METHODS: tuple[str, ...] = get_args(StartMethod)
ON_CONFLICT = ("error", "prefer_config", "prefer_context")


def strategy_config(
    owner: str,
    config: ConfigArg,
    keywords: StrategyKeywords,
    compile: CompileArg,
    *,
    start_method: str,
    on_conflict: str,
) -> dict[str, Any]:
    """The raw config of a strategy (``owner`` names it in errors): its arguments checked, the config read,
    the keywords and ``compile`` written into it and the result checked against the schema. Done at
    construction, once, before any process is launched, so a missing file, a contradiction or a bad key
    fails there ("auto" entries wait for the Trainer's values at setup)."""
    if keywords.stage is not None and keywords.stage not in (0, 1, 2, 3):
        raise ValueError(f"{owner}(stage={keywords.stage!r}): the ZeRO stage is 0, 1, 2 or 3")
    if on_conflict not in ON_CONFLICT:
        raise ValueError(f"{owner}(on_conflict={on_conflict!r}): use 'error', 'prefer_config' or 'prefer_context'")
    if start_method not in START_METHODS:
        raise ValueError(f"{owner}(start_method={start_method!r}): use 'auto', 'popen', 'fork' or 'spawn'")
    raw = apply_compile(apply_keywords(read_config(config), keywords), compile, owner)
    check_config(raw)
    return raw


# keyword -> (config path, value written for the keyword's value)
_PATHS: dict[str, tuple[str, ...]] = {
    "stage": ("zero_optimization", "stage"),
    "offload_optimizer": ("zero_optimization", "offload_optimizer", "device"),
    "offload_parameters": ("zero_optimization", "offload_param", "device"),
    "reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "loss_scale": ("fp16", "loss_scale"),
    "initial_scale_power": ("fp16", "initial_scale_power"),
    "micro_batch_size": ("train_micro_batch_size_per_gpu",),
    "sequence_parallel_size": ("sequence_parallel_size",),
}


def read_config(config: ConfigArg | Mapping[str, Any]) -> dict[str, Any]:
    """A private deep copy of the user's config (dict or JSON file); {} for None."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(os.fspath(config))
    if not path.is_file():
        raise FileNotFoundError(f"ZeroStrategy(config={str(config)!r}): no such DeepSpeed config file")
    with path.open() as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"ZeroStrategy(config={str(config)!r}) is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"ZeroStrategy(config={str(config)!r}) must hold a JSON object, got {type(raw).__name__}")
    return raw


def _lookup(raw: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = raw
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _store(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[path[-1]] = value


def _same(configured: Any, wanted: Any) -> bool:
    if isinstance(configured, bool) or isinstance(wanted, bool):
        return configured is wanted or configured == wanted
    if isinstance(configured, (int, float)) and isinstance(wanted, (int, float)):
        return float(configured) == float(wanted)
    return bool(configured == wanted)


_DEVICES = {  # device keyword -> (its on/off keyword, the offload block)
    "offload_optimizer_device": ("offload_optimizer", "offload_optimizer"),
    "offload_params_device": ("offload_parameters", "offload_param"),
}


def _apply_devices(out: dict[str, Any], given: dict[str, Any], problems: list[str]) -> None:
    """``offload_*_device`` ("cpu" / "nvme", which implies the offload) and ``nvme_path`` (written into every
    block offloaded to NVMe), as Lightning's DeepSpeedStrategy takes them."""
    for name, (flag, block) in _DEVICES.items():
        device = given.get(name)
        if device is None:
            continue
        path = ("zero_optimization", block, "device")
        configured = _lookup(out, path)
        if device not in ("cpu", "nvme"):
            problems.append(f'ZeroStrategy({name}={device!r}): use "cpu" or "nvme"')
        elif given.get(flag) is False:
            problems.append(f"ZeroStrategy({name}={device!r}) contradicts {flag}=False; remove one of them")
        elif configured not in (None, "auto", "none", device):
            problems.append(
                f"ZeroStrategy({name}={device!r}) contradicts the config's {'.'.join(path)}={configured!r}; "
                "remove one of them or make them agree"
            )
        else:
            _store(out, path, device)
    nvme_path = given.get("nvme_path")
    if nvme_path is None:
        return
    blocks = [b for _, b in _DEVICES.values() if _lookup(out, ("zero_optimization", b, "device")) == "nvme"]
    if not blocks:
        problems.append(
            "ZeroStrategy(nvme_path=...) is given but nothing is offloaded to NVMe; add "
            'offload_optimizer_device="nvme" and/or offload_params_device="nvme"'
        )
    for block in blocks:
        path = ("zero_optimization", block, "nvme_path")
        configured = _lookup(out, path)
        if configured not in (None, nvme_path):
            problems.append(
                f"ZeroStrategy(nvme_path={nvme_path!r}) contradicts the config's {'.'.join(path)}={configured!r}; "
                "remove one of them or make them agree"
            )
        else:
            _store(out, path, str(nvme_path))


def apply_keywords(raw: Mapping[str, Any], keywords: StrategyKeywords) -> dict[str, Any]:
    """``raw`` with the given keywords written in; a contradiction is a ValueError listing every one."""
    out = copy.deepcopy(dict(raw))
    problems: list[str] = []
    given = keywords.given()
    _apply_devices(out, given, problems)
    for name, value in given.items():
        if name in _DEVICES or name == "nvme_path":
            continue
        path = _PATHS[name]
        dotted = ".".join(path)
        configured = _lookup(out, path)
        if name in ("offload_optimizer", "offload_parameters"):
            # True means device "cpu"; False means no offload ("none" or absent).
            on = configured in ("cpu", "nvme")
            if configured is not None and configured != "auto" and on != value:
                problems.append(
                    f"ZeroStrategy({name}={value}) contradicts the config's {dotted}={configured!r}; "
                    "remove one of them or make them agree"
                )
            elif value and not on:
                _store(out, path, "cpu")
            continue
        if configured is not None and configured != "auto" and not _same(configured, value):
            problems.append(
                f"ZeroStrategy({name}={value!r}) contradicts the config's {dotted}={configured!r}; "
                "remove one of them or make them agree"
            )
            continue
        _store(out, path, value)
    if problems:
        raise ValueError("\n".join(problems))
    zero = out.setdefault("zero_optimization", {})
    if isinstance(zero, dict) and zero.get("stage") in (None, "auto"):
        zero["stage"] = DEFAULT_STAGE
    return out


def configured_stage(raw: Mapping[str, Any]) -> int:
    stage = _lookup(raw, ("zero_optimization", "stage"))
    return int(stage) if isinstance(stage, int) and not isinstance(stage, bool) else DEFAULT_STAGE


def states_micro_batch(raw: Mapping[str, Any]) -> bool:
    """Whether the config fixes the micro batch itself (directly or through train_batch_size)."""
    return any(raw.get(k) not in (None, "auto") for k in ("train_micro_batch_size_per_gpu", "train_batch_size"))


def resolve(
    raw: Mapping[str, Any],
    *,
    world_size: int,
    precision: str,
    micro_batch_size: int | None,
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    on_conflict: OnConflict = "error",
) -> DeepSpeedConfig:
    """Validate ``raw`` with the Trainer's values as the context (see the module docstring); ``on_conflict``
    decides a value the config states and the Trainer contradicts (``ConfigContext.on_conflict``)."""
    # No clip value from the Trainer and none stated in the config: no clipping, as under DDP and Lightning's
    # DeepSpeedStrategy (``trainer.gradient_clip_val or 0.0``), not DeepSpeed's own default of 1.0.
    clip = gradient_clip_val
    if clip is None and raw.get("gradient_clipping", "auto") == "auto":
        clip = 0.0
    context = ConfigContext(
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=accumulate_grad_batches,
        gradient_clipping=None if clip is None else float(clip),
        precision=precision,
        source="the Trainer",
        on_conflict=on_conflict,
    )
    return load_config(dict(raw), world_size=world_size, context=context)
