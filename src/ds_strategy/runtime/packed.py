"""Parameters quantized by another library: bitsandbytes' 4-bit ``Params4bit`` (QLoRA) and 8-bit
``Int8Params``.

[Note: packed parameters]
Such a parameter's storage is packed codes (two 4-bit codes per byte, or int8) that the library reads with
its own quantization state (``quant_state``: absmax, block size, code book). Its dtype says only how the
bytes are stored: ``bnb_4bit_quant_storage=torch.bfloat16`` (what FSDP's QLoRA recipe asks for) makes the
codes a bfloat16 tensor whose "values" are meaningless and often NaN bit patterns. Casting it to the
compute dtype, or sending it through float arithmetic (an fp32 scratch buffer rounds NaN payloads to one
canonical NaN), corrupts the weights. So the engine never casts one and moves it only bit for bit; stage 3
leaves it whole on every rank (it is frozen: no gradient, no optimizer state). Detected by the library's
attributes, so the package never imports bitsandbytes.
"""

from __future__ import annotations

import torch

_PACKED_TYPES = ("Params4bit", "Int8Params")


def is_packed(p: torch.Tensor) -> bool:
    """Whether ``p`` holds another library's packed quantized codes (see [Note: packed parameters])."""
    return type(p).__name__ in _PACKED_TYPES or getattr(p, "quant_state", None) is not None
