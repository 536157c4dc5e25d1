"""Lightning's precision flags and the engine's dtypes, for both faces.

``"16-mixed"`` / ``"16-true"`` select the engine's fp16 mode, ``"bf16-mixed"`` / ``"bf16-true"`` its bf16
mode, ``"32-true"`` fp32. ``EngineDtypes`` is the dtype half of both precision plugins (``ZeroPrecision``
and ``ZeroFabricPrecision``); ``own_precision`` swaps the plugin Lightning built from a flag for the face's
own, so Lightning's AMP never wraps the engine's casting and loss scaling.

Nothing here imports ``lightning.pytorch``: the Fabric face must not need the Trainer's modules.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Literal, TypeVar, cast, get_args

import torch
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module

from ds_strategy.runtime.packed import is_packed

from ._compat import _convert_fp_tensor, _DtypeContextManager

P = TypeVar("P")
D = TypeVar("D", bound="EngineDtypes")

PrecisionFlag = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
PRECISION_FLAGS: tuple[str, ...] = get_args(PrecisionFlag)
PRECISION_DTYPE: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}


def own_precision(plugin: Any, ours: type[P], plain_types: tuple[type, ...], *, owner: str, where: str) -> P | None:
    """The face's own precision plugin (``ours``) in place of the one Lightning built from its ``precision``
    flag, so that Lightning's AMP (autocast + GradScaler) never wraps the engine's own casting and loss
    scaling. Only the plain plugins (``plain_types``) carry a flag the engine can take over."""
    if plugin is None or isinstance(plugin, ours):
        return plugin
    flag = getattr(plugin, "precision", None)
    if type(plugin) not in plain_types or flag not in PRECISION_FLAGS:
        what = "64-bit" if flag == "64-true" else f"{type(plugin).__name__}(precision={flag!r})"
        raise TypeError(
            f"{owner} does not support {what}; use {where} with "
            f"{', '.join(repr(p) for p in PRECISION_FLAGS[:-1])} or {PRECISION_FLAGS[-1]!r}, or pass "
            f"plugins=[ds_strategy.lightning.{ours.__name__}(...)]"
        )
    return ours(flag)  # type: ignore[call-arg]


def check_precision_flag(precision: Any, owner: str) -> PrecisionFlag:
    precision = str(precision)
    if precision not in PRECISION_FLAGS:
        raise ValueError(
            f"{owner} does not support precision={precision!r}; choose one of "
            f"{', '.join(repr(p) for p in PRECISION_FLAGS)}"
        )
    return cast(PrecisionFlag, precision)


class EngineDtypes:
    """The dtype half of both precision plugins (mixed into ``ZeroPrecision`` and ``ZeroFabricPrecision``).

    ``"16-mixed"`` / ``"16-true"`` select the engine's fp16 mode, ``"bf16-mixed"`` / ``"bf16-true"`` its
    bf16 mode (16-bit parameters and activations, fp32 masters), as DeepSpeed does. ``"-true"``
    additionally creates the module's tensors in the 16-bit dtype, so the fp32 masters then start from
    16-bit values. No autocast, no GradScaler: the engine casts and scales the loss itself.
    """

    precision: Any  # a PrecisionFlag; Any to agree with Lightning's own annotation of the attribute
    dtype: torch.dtype
    # Set by each plugin: the strategy it serves, where its users state the flag, and Lightning's plain
    # plugins (no AMP of their own) whose flag it takes over.
    owner: ClassVar[str]
    flag_given_in: ClassVar[str]
    takes_over: ClassVar[tuple[type, ...]]

    def __init__(self, precision: PrecisionFlag = "32-true") -> None:
        self.precision = check_precision_flag(precision, self.owner)
        self.dtype = PRECISION_DTYPE[self.precision]

    @classmethod
    def adopt(cls: type[D], plugin: Any) -> D | None:
        """This plugin in place of the one Lightning built from its flag (``own_precision``)."""
        return own_precision(plugin, cls, cls.takes_over, owner=cls.owner, where=cls.flag_given_in)

    @classmethod
    def current(cls: type[D], plugin: Any) -> D:
        """The strategy's plugin: ``plugin`` when it is this one, else the default ("32-true")."""
        return plugin if isinstance(plugin, cls) else cls("32-true")

    def convert_module(self, module: Module) -> Module:
        if not self.precision.endswith("-true"):
            return module
        # module.to(dtype) but for another library's packed quantized codes (a QLoRA base: [Note: packed
        # parameters] in runtime/packed.py), whose storage dtype is not a value type: casting corrupts them.
        dtype = self.dtype
        return module._apply(lambda t: t.to(dtype) if t.is_floating_point() and not is_packed(t) else t)

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.dtype) if self.precision.endswith("-true") else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()
