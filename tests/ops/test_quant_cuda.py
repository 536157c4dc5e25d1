"""The CUDA quantization kernels against the CPU kernels (same math header quant_math.h: equal bytes and
values). Runs where torch has CUDA and a GPU; on CPU-only machines tests/ops/test_cuda_sources.py still
compiles the sources. Not run yet on a GPU in this project (no GPU was available when it was written)."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.ops import load_cuda_kernels

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_kernels() -> bool:
    if not load_cuda_kernels():
        pytest.fail("CUDA is available but the CUDA kernels did not build")
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bits", "block"), [(8, 256), (4, 128), (4, 32)])
@pytest.mark.parametrize("shape", [(1,), (17,), (100_003,), (4, 1001)])
def test_cuda_equals_cpu(
    cpu_kernels: bool, cuda_kernels: bool, dtype: torch.dtype, bits: int, block: int, shape
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    q, s = torch.ops.ds_strategy.quantize_blockwise(x, block, bits)
    qc, sc = torch.ops.ds_strategy.quantize_blockwise(x.cuda(), block, bits)
    assert torch.equal(qc.cpu(), q) and torch.equal(sc.cpu(), s)
    out = torch.empty(shape, dtype=dtype)
    torch.ops.ds_strategy.dequantize_blockwise_(q, s, block, bits, out)
    outc = torch.empty(shape, dtype=dtype, device="cuda")
    torch.ops.ds_strategy.dequantize_blockwise_(qc, sc, block, bits, outc)
    assert torch.equal(outc.cpu(), out)
    if len(shape) == 2:
        total = torch.empty(shape[1])
        torch.ops.ds_strategy.dequantize_sum_(q, s, block, bits, total)
        totalc = torch.empty(shape[1], device="cuda")
        torch.ops.ds_strategy.dequantize_sum_(qc, sc, block, bits, totalc)
        assert torch.equal(totalc.cpu(), total)
