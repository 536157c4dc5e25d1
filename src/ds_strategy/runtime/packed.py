"""Parameters quantized by another library: bitsandbytes' 4-bit ``Params4bit`` (QLoRA) and 8-bit
``Int8Params``.

[Note: packed parameters]
Such a parameter's storage is packed codes (two 4-bit codes per byte, or int8) that the library reads with
its own quantization state (``quant_state``: absmax, block size, code book). Its dtype says only how the
bytes are stored: ``bnb_4bit_quant_storage=torch.bfloat16`` (what FSDP's QLoRA recipe asks for) makes the
codes a bfloat16 tensor whose "values" are meaningless and often NaN bit patterns. Casting it to the
compute dtype, or sending it through float arithmetic (an fp32 scratch buffer rounds NaN payloads to one
canonical NaN), corrupts the weights. So the engine never casts one and moves it only bit for bit. Stage 3
partitions 4-bit ones as raw bytes, codes and quantization state together ([Note: packed partitions] in
runtime/zero/packed_store.py); 8-bit ones, and 4-bit ones bitsandbytes has already repacked for its CPU
kernel, stay whole on every rank (they are frozen: no gradient, no optimizer state). Detected by the
library's attributes, so the package never imports bitsandbytes.

[Note: the CPU repack]
bitsandbytes' CPU backend, on a machine with AVX512-BF16, repacks a 4-bit weight the first time its layer
runs in eval mode without autograd (``Linear4bit.forward``: ``self.weight.data, state =
_convert_weight_packed_for_cpu(...)``): a new tensor in another layout replaces the parameter's data, and
its quantization state is rewritten to match (absmax transposed to bfloat16). A partitioned weight's data
is a view of a gathered bucket that the next free takes away, so the repacked copy would be lost (and
the rewritten state kept). The layers whose weights stage 3 partitions therefore have that repack turned
off (``support_avx512bf16_for_cpu = False``, the flag the layer reads; put back when the engine hands
the weights back): their eval forwards run the kernel training runs, whose results differ from the
repacked bf16 kernel's in the last bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

_PACKED_TYPES = ("Params4bit", "Int8Params")
REPACK_FLAG = "support_avx512bf16_for_cpu"  # bitsandbytes' Linear4bit: repack for the CPU kernel in eval


def is_packed(p: torch.Tensor) -> bool:
    """Whether ``p`` holds another library's packed quantized codes (see [Note: packed parameters])."""
    return type(p).__name__ in _PACKED_TYPES or getattr(p, "quant_state", None) is not None


def state_tensors(p: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors of a 4-bit parameter's quantization state that grow with the weight (``absmax``, and
    under double quantization the second level's ``absmax``), which stage 3 partitions with the codes; None
    when ``p`` is not partitioned: int8 codes, or 4-bit ones already repacked for the CPU kernel (see
    [Note: the CPU repack]). The code books and the double quantization's offset are a few bytes per
    layer and stay whole."""
    state = getattr(p, "quant_state", None)
    absmax = getattr(state, "absmax", None)
    if not isinstance(absmax, torch.Tensor) or getattr(state, "packing_format_for_cpu", False):
        return None
    out = [absmax]
    second = getattr(state, "state2", None) if getattr(state, "nested", False) else None
    if isinstance(getattr(second, "absmax", None), torch.Tensor):
        out.append(second.absmax)  # type: ignore[union-attr]
    return out


def stop_repack(root: nn.Module, params: Iterable[torch.Tensor]) -> list[tuple[nn.Module, object]]:
    """Turn off bitsandbytes' CPU repack ([Note: the CPU repack]) in the modules of ``root`` holding one of
    ``params``; returns ``(module, previous flag)`` for ``restore_repack``."""
    ids = {id(p) for p in params}
    changed = []
    for m in root.modules():
        if REPACK_FLAG in vars(m) and any(id(p) in ids for p in m._parameters.values()):
            changed.append((m, getattr(m, REPACK_FLAG)))
            setattr(m, REPACK_FLAG, False)
    return changed


def restore_repack(changed: Iterable[tuple[nn.Module, object]]) -> None:
    for m, flag in changed:
        setattr(m, REPACK_FLAG, flag)
