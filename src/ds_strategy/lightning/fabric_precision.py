"""``ZeroFabricPrecision``: Fabric's precision flags mapped onto the engine's fp16 / bf16 / fp32.

The same mapping as the Trainer's ``ZeroPrecision`` (``dtypes.EngineDtypes``). Fabric calls the plugin
around every forward (``forward_context``), for the backward and for the optimizer step; ``ZeroFabricStrategy``
hands backward and step to the engine directly, so what is left here is the dtype of the module, of its
inputs and of tensors created under ``fabric.init_module()`` / ``fabric.init_tensor()``. No autocast: the
engine runs the module in its compute dtype already.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision
from typing_extensions import override

from .dtypes import EngineDtypes


class ZeroFabricPrecision(EngineDtypes, Precision):
    """Precision for ``ZeroFabricStrategy``: one of "32-true", "16-mixed", "bf16-mixed", "16-true",
    "bf16-true" (``Fabric(precision=...)`` is turned into this plugin by the strategy)."""

    owner = "ZeroFabricStrategy"
    flag_given_in = "Fabric(precision=...)"
    takes_over = (Precision, MixedPrecision, HalfPrecision)

    @override
    def forward_context(self) -> AbstractContextManager:
        return nullcontext()  # the engine casts; autocast on top would run ops in a second dtype
