"""Block-wise symmetric int8 / int4 quantization (ZeRO++'s quantized weight gathers and gradient reductions).

``quantize(x, block_size, bits)`` -> ``Quantized`` (int8 bytes, fp32 scales per block; int4 packs two
values per byte); ``dequantize_into`` writes the values back in any float dtype; ``dequantize_sum`` adds
several quantized rows into one fp32 vector (the reduction step of a quantized all-to-all). A 2-D input
is rows quantized independently, which is what an all-gather of every rank's quantized shard delivers.
The math (csrc/includes/quant_math.h): scale = absmax / qmax (qmax 127 or 7), q = round_half_even(x *
qmax / absmax), x' = q * scale, so ``|x - x'| <= scale / 2``; a block holding inf or NaN dequantizes to
NaN. CPU (OpenMP + SIMD) and CUDA kernels; other devices and dtypes use the pure-torch twins in
:mod:`ds_strategy.ops.fallback`, which give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_strategy.ops import fallback
from ds_strategy.ops.builder import load_cpu_kernels, load_cuda_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = (8, 4)


@dataclass(frozen=True)
class Quantized:
    q: torch.Tensor  # int8: rows x packed bytes (or 1-D)
    scales: torch.Tensor  # fp32: rows x blocks (or 1-D)
    block_size: int
    bits: int

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scales.numel()


def packed_numel(n: int, bits: int) -> int:
    return (n + 1) // 2 if bits == 4 else n


def num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _check(block_size: int, bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits is {bits}; expected 8 or 4")
    if block_size <= 0 or (bits == 4 and block_size % 2):
        raise ValueError(f"block_size is {block_size}; expected a positive number of elements (even for int4)")


def _kernels(device: torch.device) -> bool:
    return (device.type == "cpu" and load_cpu_kernels()) or (device.type == "cuda" and load_cuda_kernels())


def quantize(x: torch.Tensor, block_size: int, bits: int = 8) -> Quantized:
    """Quantize ``x`` (1-D, or 2-D: rows independently) in blocks of ``block_size`` elements."""
    _check(block_size, bits)
    x = x.detach()
    if x.dtype in _KERNEL_DTYPES and _kernels(x.device):
        q, scales = torch.ops.ds_strategy.quantize_blockwise(x.contiguous(), block_size, bits)
    else:
        q, scales = fallback.quantize_blockwise(x, block_size, bits)
    return Quantized(q, scales, block_size, bits)


def dequantize_into(qt: Quantized, out: torch.Tensor) -> torch.Tensor:
    """Write the values of ``qt`` into ``out`` (same shape as the quantized input; contiguous)."""
    if out.dtype in _KERNEL_DTYPES and out.is_contiguous() and _kernels(out.device):
        torch.ops.ds_strategy.dequantize_blockwise_(qt.q, qt.scales, qt.block_size, qt.bits, out)
        return out
    return fallback.dequantize_blockwise_(qt.q, qt.scales, qt.block_size, qt.bits, out)


def dequantize(qt: Quantized, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=qt.q.device)
    return dequantize_into(qt, out)


def dequantize_sum(qt: Quantized, out: torch.Tensor) -> torch.Tensor:
    """``out`` (1-D fp32) = the sum of the dequantized rows of ``qt`` (rows x n), in row order."""
    if out.dtype != torch.float32 or out.dim() != 1:
        raise ValueError(f"dequantize_sum: out is {out.dtype} with {out.dim()} dims; expected a 1-D float32 tensor")
    if out.is_contiguous() and _kernels(out.device):
        torch.ops.ds_strategy.dequantize_sum_(qt.q, qt.scales, qt.block_size, qt.bits, out)
        return out
    return fallback.dequantize_sum_(qt.q, qt.scales, qt.block_size, qt.bits, out)
