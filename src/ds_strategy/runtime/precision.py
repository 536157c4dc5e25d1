"""Which dtype computes, accumulates and communicates, and the loss scaler: decided once from the config.

[Note: precision of gradients]
Parameters live in the compute dtype (fp32, bf16 or fp16); backward produces gradients in that dtype.
The engine accumulates them across micro-steps in ``data_types.grad_accum_dtype`` (default fp32) and
reduces them across ranks in ``communication_data_type``, whose default is DeepSpeed's: the compute dtype
(bf16/fp16 training sends half the bytes, with a rounding per reduction). ``"fp32"`` makes the averaged
gradient as exact as fp32 arithmetic allows before it meets the fp32 master weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ds_strategy.config import DeepSpeedConfig

from .loss_scaler import LossScaler

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """[Note: input casting]
    fp16 follows DeepSpeed: the engine's forward casts floating *positional* inputs to fp16 only with
    ``fp16.auto_cast: true``; otherwise inputs reach the module as given (an fp32 attention mask of
    ``finfo(float32).min`` would become -inf in fp16). bf16 casts floating inputs, positional and keyword
    (a ds_strategy convenience DeepSpeed lacks, kept because bf16 models are usually fed fp32 data; note that
    ``finfo(float32).min`` rounds to -inf in bf16 too: build masks in the model's dtype, or boolean).
    """

    compute_dtype: torch.dtype
    accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    cast_args: bool = True  # cast floating positional inputs to compute_dtype (see the note)
    cast_kwargs: bool = True  # ... and keyword inputs

    @classmethod
    def from_config(cls, config: DeepSpeedConfig) -> Precision:
        accum = _DTYPES[config.data_types.grad_accum_dtype or "fp32"]
        # DeepSpeed's engine: the configured dtype, else fp16 / bf16 when training in it, else fp32.
        comm = _DTYPES[config.communication_data_type] if config.communication_data_type else config.precision_dtype
        if config.fp16_enabled:
            return cls(config.precision_dtype, accum, comm, cast_args=config.fp16.auto_cast, cast_kwargs=False)
        return cls(config.precision_dtype, accum, comm)

    @property
    def is_fp16(self) -> bool:
        return self.compute_dtype == torch.float16

    @property
    def is_low_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    def cast_forward_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The forward's inputs as the module receives them (see [Note: input casting])."""
        return (
            self.cast_inputs(args) if self.cast_args else args,
            self.cast_inputs(kwargs) if self.cast_kwargs else kwargs,
        )

    def cast_inputs(self, value: Any) -> Any:
        """Cast floating-point tensors (also inside tuples, lists and dicts) to the compute dtype."""
        if not self.is_low_precision:
            return value
        if isinstance(value, torch.Tensor):
            return value.to(self.compute_dtype) if value.is_floating_point() else value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*(self.cast_inputs(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_inputs(v) for v in value)
        if isinstance(value, Mapping):
            return type(value)({k: self.cast_inputs(v) for k, v in value.items()})  # type: ignore[call-arg]
        return value


def make_loss_scaler(config: DeepSpeedConfig) -> LossScaler:
    """fp16: the configured static/dynamic scaler; bf16 and fp32: a static scale of 1."""
    return LossScaler.from_config(config.fp16) if config.fp16_enabled else LossScaler()
