"""Block-wise symmetric int8/int4 quantization: the kernels against the pure-torch twin (same bytes), the
round-trip error bound against a float64 torch reference, and the op boundary's refusals."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.ops import fallback
from ds_strategy.ops.quant import dequantize, dequantize_into, dequantize_sum, quantize

pytestmark = pytest.mark.kernels

# 1, odd, below/above every SIMD width, a block tail, and a large odd size.
SIZES = (1, 7, 15, 17, 64, 257, 100_003)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FORMATS = ((8, 64), (8, 2048), (4, 32), (4, 128))


def _x(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=gen) * torch.logspace(-3, 2, n).roll(n // 3)  # blocks of very different scales
    return x.to(dtype)


def _reference(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 torch reference: per-block scale absmax / qmax and the dequantized values."""
    qmax = 7 if bits == 4 else 127
    v = x.double().reshape(-1)
    n = v.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block, dtype=torch.float64)
    pad[:n] = v
    absmax = pad.view(nb, block).abs().amax(dim=1)
    scale = absmax / qmax
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    q = torch.round(pad.view(nb, block) * inv[:, None]).clamp(-qmax, qmax)
    return scale, (q * scale[:, None]).reshape(-1)[:n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("bits", "block"), FORMATS)
def test_kernel_matches_fallback_bytes(cpu_kernels: bool, size: int, dtype: torch.dtype, bits: int, block: int) -> None:
    x = _x(size, dtype)
    q, scales = torch.ops.ds_strategy.quantize_blockwise(x, block, bits)
    ref_q, ref_scales = fallback.quantize_blockwise(x, block, bits)
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    assert torch.equal(q, ref_q)
    out = torch.empty(size, dtype=dtype)
    torch.ops.ds_strategy.dequantize_blockwise_(q, scales, block, bits, out)
    ref_out = fallback.dequantize_blockwise_(ref_q, ref_scales, block, bits, torch.empty(size, dtype=dtype))
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("bits", "block"), FORMATS)
def test_round_trip_error_bound(cpu_kernels: bool, size: int, dtype: torch.dtype, bits: int, block: int) -> None:
    """|x - x'| <= scale/2 per element (+ fp32 rounding of q*scale and the output dtype's rounding); the fp32
    scales equal the float64 reference's to fp32 rounding."""
    x = _x(size, dtype)
    qt = quantize(x, block, bits)
    back = dequantize(qt, (size,), torch.float32)
    ref_scale, ref_back = _reference(x, block, bits)
    torch.testing.assert_close(qt.scales.double(), ref_scale, rtol=2e-7, atol=0)
    per_elem = ref_scale.repeat_interleave(block)[:size]
    err = (back.double() - x.double()).abs()
    assert (err <= per_elem * (0.5 + 1e-5) + 1e-30).all(), float((err / per_elem.clamp_min(1e-30)).max())
    # Same values as the float64 reference except where x*inv sits within fp32 rounding of a .5 tie.
    close = (back.double() - ref_back).abs() <= per_elem * 1e-5
    assert close.float().mean() > 0.999
    # The round trip in the input dtype adds that dtype's rounding only.
    back_t = dequantize(qt, (size,), dtype)
    torch.testing.assert_close(back_t, back.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize(("bits", "block"), FORMATS)
def test_rows_are_independent(cpu_kernels: bool, bits: int, block: int) -> None:
    rows = torch.stack([_x(301, torch.float32, seed=s) * (10.0**s) for s in range(4)])
    qt = quantize(rows, block, bits)
    for r in range(4):
        single = quantize(rows[r], block, bits)
        assert torch.equal(qt.q[r], single.q) and torch.equal(qt.scales[r], single.scales)
    back = torch.empty_like(rows)
    dequantize_into(qt, back)
    for r in range(4):
        assert torch.equal(back[r], dequantize(quantize(rows[r], block, bits), (301,)))


@pytest.mark.parametrize(("bits", "block"), FORMATS)
def test_dequantize_sum_accumulates_in_fp32(cpu_kernels: bool, bits: int, block: int) -> None:
    rows = torch.stack([_x(1001, torch.float32, seed=s) for s in range(5)])
    qt = quantize(rows, block, bits)
    out = dequantize_sum(qt, torch.empty(1001))
    parts = torch.empty_like(rows)
    dequantize_into(qt, parts)
    expected = parts.double().sum(dim=0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    ref = fallback.dequantize_sum_(qt.q, qt.scales, block, bits, torch.empty(1001))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_block_dequantizes_to_nan(cpu_kernels: bool, bits: int, bad: float) -> None:
    x = torch.randn(100)
    x[37] = bad
    qt = quantize(x, 32, bits)
    back = dequantize(qt, (100,))
    assert back[32:64].isnan().all()
    assert torch.isfinite(back[:32]).all() and torch.isfinite(back[64:]).all()
    ref_q, ref_scales = fallback.quantize_blockwise(x, 32, bits)
    assert torch.equal(qt.q, ref_q) and ref_scales[1].isnan()


def test_zero_block_has_zero_scale(cpu_kernels: bool) -> None:
    x = torch.zeros(50)
    x[40] = 3.0
    qt = quantize(x, 16, 8)
    assert qt.scales[:2].eq(0).all() and torch.equal(dequantize(qt, (50,)), x)


def test_op_refuses_bad_arguments(cpu_kernels: bool) -> None:
    with pytest.raises(RuntimeError, match="bits is 3; expected 8 or 4"):
        torch.ops.ds_strategy.quantize_blockwise(torch.randn(8), 4, 3)
    with pytest.raises(RuntimeError, match="block_size is 5; int4 packs two elements per byte"):
        torch.ops.ds_strategy.quantize_blockwise(torch.randn(8), 5, 4)
    q, s = torch.ops.ds_strategy.quantize_blockwise(torch.randn(8), 4, 8)
    with pytest.raises(RuntimeError, match="q has 8 bytes; 1 rows of 9 elements"):
        torch.ops.ds_strategy.dequantize_blockwise_(q, s, 4, 8, torch.empty(9))
    with pytest.raises(RuntimeError, match="x has dtype Double"):
        torch.ops.ds_strategy.quantize_blockwise(torch.randn(8, dtype=torch.float64), 4, 8)


def test_wrapper_falls_back_for_other_dtypes(cpu_kernels: bool) -> None:
    x = torch.randn(20, dtype=torch.float64)
    qt = quantize(x, 8, 8)
    ref_q, _ = fallback.quantize_blockwise(x.float(), 8, 8)
    assert torch.equal(qt.q, ref_q)
