"""``ZeroPrecision``: Lightning's precision flags mapped onto the engine's fp16 / bf16 / fp32 settings.

The engine owns loss scaling (fp16, DeepSpeed's dynamic scaler configured in the ``fp16`` block), the fp32
master weights and gradient clipping, so this plugin never stacks Lightning's AMP ``GradScaler`` or autocast
on top: backward and the optimizer step are handed to the engine. The engine clips inside its step, by the
global norm over all partitions: by the config's ``gradient_clipping`` (``Trainer(gradient_clip_val=...)``),
or, for one step, by the max norm a ``LightningModule.clip_gradients`` call asked for (from an overridden
``configure_gradient_clipping``, or under manual optimization before ``optimizer.step()``).

Which flag selects which engine mode: ``dtypes.EngineDtypes``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from ds_strategy.runtime import ZeroEngine

from .core import clipping_at
from .dtypes import EngineDtypes

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ZeroPrecision(EngineDtypes, Precision):
    """Precision for ``ZeroStrategy``: ``precision`` is one of "32-true", "16-mixed", "bf16-mixed",
    "16-true", "bf16-true". The dtype handling (``convert_module``, ``convert_input``, the init contexts)
    is ``dtypes.EngineDtypes``, the same as Fabric's ``ZeroFabricPrecision``."""

    owner = "ZeroStrategy"
    flag_given_in = "Trainer(precision=...)"
    takes_over = (Precision, MixedPrecision, HalfPrecision)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clip_request: float | None = None  # the max norm a clip_gradients call asked of the next step

    # ------------------------------------------------------------------ the engine does the rest
    # [Note: who decides the accumulation boundary] (strategy.py): Lightning does. Inside a window the
    # strategy's block_backward_sync has told the engine "not a boundary"; optimizer_step tells it
    # "boundary" before the closure's backward.
    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        engine = _engine(model)
        if not model.automatic_optimization:
            engine.set_gradient_accumulation_boundary(False)  # manual: optimizer.step() reduces
        if args:
            raise TypeError(f"ZeroStrategy backward takes no extra positional arguments, got {len(args)}")
        retain_graph = bool(kwargs.pop("retain_graph", False))
        if kwargs:
            raise TypeError(f"ZeroStrategy backward does not accept {', '.join(kwargs)}")
        # Lightning already divided the loss by accumulate_grad_batches: the engine does not divide again.
        engine.backward(tensor, retain_graph=retain_graph, scale_wrt_gas=False)
        if model.automatic_optimization and not engine.is_gradient_accumulation_boundary():
            # Lightning calls no optimizer step inside an accumulation window; the engine counts every
            # micro-batch (micro_steps, DeepSpeed's step() after each backward) and steps nothing here.
            engine.step()

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("ZeroStrategy cannot drive LBFGS: its step re-evaluates the closure")
        if kwargs:
            raise TypeError(f"optimizer.step() under ZeroStrategy takes no arguments, got {', '.join(kwargs)}")
        engine = _engine(model)
        engine.set_gradient_accumulation_boundary(True)  # the closure's backward ends the accumulation window
        closure_result = closure()
        with _grads_for_hooks(model, engine):
            self._after_closure(model, optimizer)  # on_before_optimizer_step (callbacks, then the module)
        if model.automatic_optimization and closure_result is None:
            raise MisconfigurationException(
                "training_step returned None (skip this step) under ZeroStrategy: every rank must run backward "
                "on every step, because the gradient reduction is a collective"
            )
        max_norm, self._clip_request = self._clip_request, None
        try:
            with clipping_at(engine, max_norm):
                return engine.step()
        finally:
            engine.set_gradient_accumulation_boundary(None)  # the override lasts until reset, as DeepSpeed's

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """The next optimizer step clips by the global norm at ``clip_val`` (the engine clips inside its step,
        across all partitions: the parameters hold no ``.grad`` to clip now). 0 asks nothing: that step clips
        by the config's ``gradient_clipping``, as Lightning's own call does without ``gradient_clip_val``."""
        if not clip_val:
            return
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
        if algorithm != GradClipAlgorithmType.NORM:
            raise norm_only(
                f"clip_gradients(gradient_clip_val={clip_val}, gradient_clip_algorithm={algorithm.value!r})"
            )
        self._clip_request = float(clip_val)


def norm_only(given: str) -> MisconfigurationException:
    """The error for a clipping request other than by norm (``given``: how it was asked for)."""
    return MisconfigurationException(
        "ZeroStrategy clips gradients by their global norm only (across all partitions); "
        f"{given} is not supported. Use gradient_clip_algorithm='norm'"
    )


def _grads_for_hooks(model: pl.LightningModule, engine: ZeroEngine) -> AbstractContextManager[None]:
    """The reduced gradients as ``p.grad`` while ``on_before_optimizer_step`` runs, as DDP has them there
    (``grad_norm(self, norm_type=2)``, custom clipping): only when the module or a callback overrides that
    hook, since it costs a full gradient copy and, at stages 1-3, an all-gather per bucket (see
    [Note: gradients as p.grad] in runtime/zero/access.py)."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    hook = "on_before_optimizer_step"
    used = is_overridden(hook, model, pl.LightningModule) or any(
        is_overridden(hook, cb, pl.Callback)
        for cb in model.trainer.callbacks  # type: ignore[attr-defined]
    )
    return engine.state_access.visible_grads() if used else nullcontext()


def _engine(model: pl.LightningModule) -> ZeroEngine:
    """The engine Lightning trains through (``trainer.model``, as Lightning's DeepSpeedPrecision reads it)."""
    engine = model.trainer.model
    if not isinstance(engine, ZeroEngine):
        raise TypeError(
            f"ZeroPrecision drives a ds_strategy ZeroEngine (ZeroStrategy's model), not {type(engine).__name__}"
        )
    return engine
