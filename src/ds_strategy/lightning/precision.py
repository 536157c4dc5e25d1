"""``ZeroPrecision``: Lightning's precision flags mapped onto the engine's fp16 / bf16 / fp32 settings.

The engine owns loss scaling (fp16, DeepSpeed's dynamic scaler configured in the ``fp16`` block), the fp32
master weights and gradient clipping, so this plugin never stacks Lightning's AMP ``GradScaler`` or autocast
on top: backward and the optimizer step are handed to the engine, clipping is a no-op here.

``"16-mixed"`` and ``"16-true"`` both select the engine's fp16 mode, ``"bf16-mixed"`` and ``"bf16-true"``
its bf16 mode (16-bit parameters and activations, fp32 masters), as DeepSpeed does. ``"-true"`` additionally
creates the module's tensors in the 16-bit dtype (``tensor_init_context``), so the fp32 masters then start
from 16-bit values.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .strategy import ZeroStrategy

PrecisionFlag = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]

_DTYPE: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}


class ZeroPrecision(Precision):
    """Precision for ``ZeroStrategy``: ``precision`` is one of "32-true", "16-mixed", "bf16-mixed",
    "16-true", "bf16-true"."""

    def __init__(self, precision: PrecisionFlag = "32-true") -> None:
        precision = cast(PrecisionFlag, str(precision))
        if precision not in get_args(PrecisionFlag):
            raise ValueError(
                f"ZeroStrategy does not support precision={precision!r}; choose one of "
                f"{', '.join(repr(p) for p in get_args(PrecisionFlag))}"
            )
        self.precision = precision
        self.dtype = _DTYPE[precision]

    # ------------------------------------------------------------------ dtypes
    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.dtype) if self.precision.endswith("-true") else module

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype) if self.precision.endswith("-true") else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    # ------------------------------------------------------------------ the engine does the rest
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        _strategy(model).engine_backward(tensor, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("ZeroStrategy cannot drive LBFGS: its step re-evaluates the closure")
        strategy = _strategy(model)
        strategy.begin_boundary()  # the closure's backward ends the accumulation window
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise MisconfigurationException(
                "training_step returned None (skip this step) under ZeroStrategy: every rank must run backward "
                "on every step, because the gradient reduction is a collective"
            )
        return strategy.engine_step(**kwargs)

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Nothing to do: the engine clips by the global norm (``gradient_clip_val`` went into its config)."""


def _strategy(model: pl.LightningModule) -> ZeroStrategy:
    from .strategy import ZeroStrategy

    strategy = model.trainer.strategy
    if not isinstance(strategy, ZeroStrategy):
        raise TypeError(f"ZeroPrecision only works with ZeroStrategy, not {type(strategy).__name__}")
    return strategy
