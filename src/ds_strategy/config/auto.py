"""Resolve "auto" (and absent) config values from a ``ConfigContext``; resolve the batch triple.

Rules, per value the context can supply (micro batch, accumulation, clipping, precision, optimizer and
scheduler params):

- config "auto" or absent, context has a value  -> the context value;
- config explicit, context silent or equal       -> the config value;
- config explicit, context disagrees             -> ``context.on_conflict`` decides: a problem
  (default), or a ``ConfigConflictWarning`` that says which value won.

Remaining "auto" values fall back to the schema default, except inside ``optimizer.params`` and
``scheduler.params``: a guessed learning rate or step count would be wrong silently, so those stay
"auto" and the typed config reports them as unresolved.

This runs even when validation already found problems (so every problem is reported in one pass);
values of the wrong type are skipped here because the schema has reported them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .batch import BatchSizes, check_without_world_size, resolve_batch_sizes
from .context import ConfigContext
from .errors import ConfigError, ConfigProblem, format_value, join_path
from .frozen import thaw
from .schema import Schema, child_schema, load_schema, resolve

AUTO = "auto"
_MISSING: Any = object()
# "auto" in these stays unresolved rather than falling back to a default (see module docstring).
UNRESOLVED_AUTO_SECTIONS = ("optimizer.params", "scheduler.params")
# "auto" in these is a value of its own, kept as written: the autotuner reads the device's free memory.
KEPT_AUTO = ("autotuning.max_memory_per_rank",)


@dataclass
class Resolution:
    config: dict[str, Any]
    world_size: int | None = None
    batch: BatchSizes | None = None
    # Known parts of an unresolved batch triple (train, micro, accumulation).
    partial_batch: tuple[int | None, int | None, int | None] = (None, None, None)
    problems: list[ConfigProblem] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


def resolve_auto(config: dict[str, Any], context: ConfigContext | None, world_size: int | None) -> Resolution:
    ctx = context or ConfigContext()
    res = Resolution(copy.deepcopy(config))
    res.world_size = _world_size(world_size, ctx, res)
    _batch(ctx, res)
    _gradient_clipping(ctx, res)
    _precision(ctx, res)
    _zero_sizes(ctx, res)
    _params(ctx, res, "optimizer", ctx.optimizer_params)
    _params(ctx, res, "scheduler", ctx.scheduler_params)
    _drop_remaining_auto(res.config, load_schema(), "")
    return res


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pick(res: Resolution, ctx: ConfigContext, path: str, configured: Any, offered: Any, offered_as: str) -> Any:
    """The value to use for ``path``: config vs context, with the conflict policy. _MISSING = neither."""
    explicit = configured is not _MISSING and configured != AUTO
    if offered is None:
        return configured if explicit else _MISSING
    if not explicit or configured == offered:
        return offered
    said = f"the config says {format_value(configured)} but {ctx.source} says {format_value(offered)} ({offered_as})"
    if ctx.on_conflict == "prefer_config":
        res.conflicts.append(
            f"{path}: {said}; using the config value {format_value(configured)} (on_conflict='prefer_config')"
        )
        return configured
    if ctx.on_conflict == "prefer_context":
        res.conflicts.append(
            f"{path}: {said}; using {ctx.source}'s value {format_value(offered)} (on_conflict='prefer_context')"
        )
        return offered
    res.problems.append(
        ConfigProblem(
            path,
            f'{said}. Set it to "auto" (or remove it) to use {ctx.source}\'s value, make the two agree, '
            "or choose a winner with on_conflict='prefer_config' / 'prefer_context'",
        )
    )
    return configured


def _world_size(explicit: int | None, ctx: ConfigContext, res: Resolution) -> int | None:
    if explicit is not None and not _is_count(explicit):
        res.problems.append(ConfigProblem("world_size", f"got {explicit!r}; expected a positive integer"))
        return None
    if explicit is not None and ctx.world_size is not None and explicit != ctx.world_size:
        res.problems.append(
            ConfigProblem(
                "world_size",
                f"load_config(world_size={explicit}) disagrees with {ctx.source} (world_size={ctx.world_size})",
            )
        )
        return None
    ranks = explicit if explicit is not None else ctx.world_size
    return ranks if ranks is None else _data_parallel(ranks, res)


def _data_parallel(ranks: int, res: Resolution) -> int | None:
    """The ranks' data-parallel size: a sequence-parallel group of ``sequence_parallel_size`` ranks holds one
    sequence between them, so it counts as one data-parallel rank in the batch arithmetic."""
    sp = res.config.get("sequence_parallel_size", 1)
    if not _is_count(sp) or sp == 1:
        return ranks
    if ranks % sp:
        valid = [d for d in range(1, ranks + 1) if ranks % d == 0]
        res.problems.append(
            ConfigProblem(
                "sequence_parallel_size", f"{sp} does not divide the {ranks} ranks (valid for {ranks} ranks: {valid})"
            )
        )
        return None
    return ranks // sp


def _batch(ctx: ConfigContext, res: Resolution) -> None:
    cfg = res.config
    raw = {
        k: cfg.pop(k, _MISSING)
        for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    }
    if any(v is not _MISSING and v != AUTO and not _is_count(v) for v in raw.values()):
        return  # reported by the schema; arithmetic on it would only add noise
    tb = raw["train_batch_size"] if _is_count(raw["train_batch_size"]) else None
    mb = _pick(
        res,
        ctx,
        "train_micro_batch_size_per_gpu",
        raw["train_micro_batch_size_per_gpu"],
        ctx.micro_batch_size,
        "micro_batch_size",
    )
    gas = _pick(
        res,
        ctx,
        "gradient_accumulation_steps",
        raw["gradient_accumulation_steps"],
        ctx.gradient_accumulation_steps,
        "gradient_accumulation_steps",
    )
    mb = None if mb is _MISSING else mb
    gas = None if gas is _MISSING else gas
    res.partial_batch = (tb, mb, gas)
    try:
        if res.world_size is not None and (tb is not None or mb is not None):
            res.batch = resolve_batch_sizes(tb, mb, gas, res.world_size)
        elif tb is not None and mb is not None and gas is not None:
            check_without_world_size(tb, mb, gas)
    except ConfigError as exc:
        res.problems.extend(exc.problems)


def _gradient_clipping(ctx: ConfigContext, res: Resolution) -> None:
    configured = res.config.get("gradient_clipping", _MISSING)
    if configured is not _MISSING and configured != AUTO and not (_is_number(configured) and configured >= 0):
        return
    value = _pick(res, ctx, "gradient_clipping", configured, ctx.gradient_clipping, "gradient_clipping")
    if value is _MISSING:
        res.config.pop("gradient_clipping", None)
    else:
        res.config["gradient_clipping"] = value


def _precision(ctx: ConfigContext, res: Resolution) -> None:
    cfg = res.config
    sections = {name: cfg.get(name) for name in ("fp16", "bf16")}
    if any(s is not None and not isinstance(s, dict) for s in sections.values()):
        return
    flags = {name: (s or {}).get("enabled", _MISSING) for name, s in sections.items()}
    if any(f is not _MISSING and f != AUTO and not isinstance(f, bool) for f in flags.values()):
        return
    wanted = ctx.precision_kind
    if wanted is not None:
        desired = {"fp16": wanted == "fp16", "bf16": wanted == "bf16"}
        clash = [name for name, flag in flags.items() if isinstance(flag, bool) and flag != desired[name]]
        if clash:
            configured = next((n for n, f in flags.items() if f is True), "fp32")
            stated = ", ".join(f"{n}.enabled={format_value(flags[n])}" for n in clash)
            said = (
                f"the config selects {configured} ({stated}) "
                f"but {ctx.source} says precision={ctx.precision!r} ({wanted})"
            )
            path = f"{clash[0]}.enabled"
            if ctx.on_conflict == "error":
                res.problems.append(
                    ConfigProblem(
                        path,
                        f'{said}. Set fp16.enabled / bf16.enabled to "auto" to follow {ctx.source}, make them agree, '
                        "or choose a winner with on_conflict='prefer_config' / 'prefer_context'",
                    )
                )
                return
            if ctx.on_conflict == "prefer_config":
                res.conflicts.append(f"{path}: {said}; using the config's {configured} (on_conflict='prefer_config')")
                desired = {n: (f is True) for n, f in flags.items()}
            else:
                res.conflicts.append(f"{path}: {said}; using {ctx.source}'s {wanted} (on_conflict='prefer_context')")
    else:
        desired = {name: flag is True for name, flag in flags.items()}
    for name in ("fp16", "bf16"):
        if desired[name]:
            cfg.setdefault(name, {})["enabled"] = True
        elif isinstance(cfg.get(name), dict):
            cfg[name]["enabled"] = False


def _zero_sizes(ctx: ConfigContext, res: Resolution) -> None:
    zero = res.config.get("zero_optimization")
    if not isinstance(zero, dict) or ctx.hidden_size is None:
        return
    h = ctx.hidden_size
    # The Hugging Face integration's rule of thumb for "auto" ZeRO buckets.
    rules = {
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    for key, value in rules.items():
        if zero.get(key) == AUTO:
            zero[key] = value


def _params(ctx: ConfigContext, res: Resolution, section: str, offered: Any) -> None:
    body = res.config.get(section)
    if not isinstance(body, dict) or offered is None:
        return
    params = body.setdefault("params", {})
    if not isinstance(params, dict):
        return
    for key, value in offered.items():
        chosen = _pick(
            res, ctx, f"{section}.params.{key}", params.get(key, _MISSING), thaw(value), f"{section}_params[{key!r}]"
        )
        if chosen is not _MISSING:
            params[key] = chosen


def _drop_remaining_auto(section: dict[str, Any], node: Schema, path: str) -> None:
    """Remove leftover "auto" values that have a schema default, so the default fills them."""
    node = resolve(node)
    for key in list(section):
        full = join_path(path, key)
        if full in UNRESOLVED_AUTO_SECTIONS or full in KEPT_AUTO:
            continue
        child = child_schema(node, key, section)
        value = section[key]
        if child is None:
            continue
        if value == AUTO and "default" in child:
            del section[key]
        elif isinstance(value, dict) and not child.get("x-ignored"):
            _drop_remaining_auto(value, child, full)
