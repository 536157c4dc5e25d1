"""What the caller knows that the config may leave as "auto".

The Lightning adapter fills a ``ConfigContext`` from the Trainer (micro batch from the dataloader,
``accumulate_grad_batches``, ``gradient_clip_val``, ``precision``); ``initialize()`` fills it from its
arguments. ``on_conflict`` decides what happens when the config states a value explicitly and the
context disagrees: ``"error"`` (default) raises, ``"prefer_config"`` / ``"prefer_context"`` keep one side
and warn which value won. A disagreement is never resolved silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError, ConfigProblem, did_you_mean
from .frozen import freeze

OnConflict = Literal["error", "prefer_config", "prefer_context"]
PrecisionKind = Literal["fp16", "bf16", "fp32"]

# Lightning precision flags, torch dtype names and DeepSpeed spellings, by the mode they select.
_PRECISION_KINDS: dict[str, PrecisionKind] = {
    **dict.fromkeys(("16-mixed", "16-true", "16", "fp16", "float16", "half", "torch.float16"), "fp16"),
    **dict.fromkeys(("bf16-mixed", "bf16-true", "bf16", "bfloat16", "torch.bfloat16"), "bf16"),
    **dict.fromkeys(
        ("32-true", "32", "fp32", "float32", "float", "torch.float32", "64-true", "64", "float64", "torch.float64"),
        "fp32",
    ),
}


def precision_kind(precision: Any) -> PrecisionKind:
    """Map a Lightning precision flag (``"bf16-mixed"``, ``16`` ...) or a dtype name to fp16/bf16/fp32."""
    key = str(precision).strip().lower()
    if key not in _PRECISION_KINDS:
        raise ConfigError(
            [
                ConfigProblem(
                    "context.precision",
                    f"got {precision!r}; expected a Lightning precision such as '16-mixed', 'bf16-mixed' or "
                    f"'32-true' (or a dtype name such as 'bfloat16')",
                )
            ]
        )
    return _PRECISION_KINDS[key]


@dataclass(frozen=True, kw_only=True)
class ConfigContext:
    """Values known outside the config, used to fill "auto" (and absent) config values.

    ``source`` names the context in messages ("the Trainer"). ``optimizer_params`` and
    ``scheduler_params`` fill "auto" entries of ``optimizer.params`` / ``scheduler.params``;
    ``hidden_size`` fills the ZeRO bucket sizes the way Hugging Face's integration does.
    """

    world_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    precision: str | int | None = None
    hidden_size: int | None = None
    optimizer_params: Mapping[str, Any] | None = None
    scheduler_params: Mapping[str, Any] | None = None
    source: str = "the context"
    on_conflict: OnConflict = "error"

    def __post_init__(self) -> None:
        problems: list[ConfigProblem] = []
        for name in ("world_size", "micro_batch_size", "gradient_accumulation_steps", "hidden_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(ConfigProblem(f"context.{name}", f"got {value!r}; expected a positive integer or None"))
        clip = self.gradient_clipping
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
            problems.append(ConfigProblem("context.gradient_clipping", f"got {clip!r}; expected a number >= 0 or None"))
        if self.on_conflict not in ("error", "prefer_config", "prefer_context"):
            problems.append(
                ConfigProblem(
                    "context.on_conflict",
                    f"got {self.on_conflict!r}; expected 'error', 'prefer_config' or 'prefer_context'",
                )
            )
        if self.precision is not None:
            try:
                precision_kind(self.precision)
            except ConfigError as exc:
                problems.extend(exc.problems)
        for name in ("optimizer_params", "scheduler_params"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Mapping):
                problems.append(ConfigProblem(f"context.{name}", f"got {value!r}; expected a mapping or None"))
            else:
                # Frozen so the context stays hashable and cannot change under a built config.
                object.__setattr__(self, name, freeze(value))
        if problems:
            raise ConfigError(problems)

    @property
    def precision_kind(self) -> PrecisionKind | None:
        return None if self.precision is None else precision_kind(self.precision)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ConfigContext:
        """Build from a plain mapping, rejecting unknown names with a did-you-mean."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [
            ConfigProblem(
                f"context.{key}",
                "unknown context field; " + (did_you_mean(str(key), names) or f"valid: {', '.join(names)}"),
            )
            for key in values
            if key not in names
        ]
        if unknown:
            raise ConfigError(unknown)
        return cls(**dict(values))


def as_context(context: ConfigContext | Mapping[str, Any] | None) -> ConfigContext | None:
    if context is None or isinstance(context, ConfigContext):
        return context
    if isinstance(context, Mapping):
        return ConfigContext.from_mapping(context)
    raise TypeError(f"context must be a ConfigContext, a mapping or None, got {type(context).__name__}")
