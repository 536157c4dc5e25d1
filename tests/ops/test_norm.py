"""The fused global-norm kernel against its pure-torch reference, on sizes that hit every SIMD tail."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.ops import fallback, multi_tensor_l2norm
from tests.gil import assert_releases_the_gil

pytestmark = pytest.mark.kernels

SIZES = (1, 15, 17, 4097, 1_000_003)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.ds_strategy.multi_tensor_l2norm(tensors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_matches_reference(cpu_kernels: bool, size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(size)
    tensors = [torch.randn(size, generator=gen).to(dtype), torch.randn(3, size % 7 + 1, generator=gen).to(dtype)]
    norm, found_inf = _kernel(tensors)
    ref_norm, ref_inf = fallback.multi_tensor_l2norm(tensors)
    torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0.0)
    assert found_inf.item() == ref_inf.item() == 0.0
    assert norm.dtype == torch.float32 and norm.dim() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_planted_nonfinite_is_found(cpu_kernels: bool, size: int, dtype: torch.dtype, bad: float) -> None:
    tensors = [torch.ones(5, dtype=dtype), torch.randn(size).to(dtype)]
    tensors[1][size // 2] = bad  # middle of the tensor, also the last SIMD tail for small sizes
    _, found_inf = _kernel(tensors)
    _, ref_inf = fallback.multi_tensor_l2norm(tensors)
    assert found_inf.item() == ref_inf.item() == 1.0


def test_last_element_of_tail_is_seen(cpu_kernels: bool) -> None:
    for size in SIZES:
        t = torch.zeros(size)
        t[-1] = float("nan")
        assert _kernel([t])[1].item() == 1.0, size
        t[-1] = 3.0
        assert _kernel([t])[0].item() == 3.0, size


def test_huge_finite_values_are_not_reported_as_overflow(cpu_kernels: bool) -> None:
    t = torch.full((33,), 3e30)  # squares overflow fp32, the values themselves are finite
    norm, found_inf = _kernel([t])
    assert found_inf.item() == 0.0
    # Summed in double: the norm itself (1.7e31) fits fp32 and comes out right.
    torch.testing.assert_close(norm, torch.tensor(3e30 * 33**0.5), rtol=1e-6, atol=0)


def test_mixed_dtypes_in_one_call(cpu_kernels: bool) -> None:
    tensors = [torch.randn(4097).to(d) for d in DTYPES]
    torch.testing.assert_close(_kernel(tensors)[0], fallback.multi_tensor_l2norm(tensors)[0], rtol=2e-6, atol=0)


def test_op_boundary_checks(cpu_kernels: bool) -> None:
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Double"):
        _kernel([torch.ones(3), torch.ones(3, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match=r"tensors\[0\] is not contiguous"):
        _kernel([torch.ones(4, 4).t()])


def test_wrapper_handles_views_empties_and_other_dtypes(cpu_kernels: bool) -> None:
    base = torch.randn(8, 8)
    view = base.t()
    assert multi_tensor_l2norm([]) == (torch.tensor(0.0), torch.tensor(0.0))
    torch.testing.assert_close(multi_tensor_l2norm([view, torch.empty(0)])[0], base.norm(), rtol=1e-6, atol=0)
    doubles = [torch.randn(10, dtype=torch.float64)]
    torch.testing.assert_close(multi_tensor_l2norm(doubles)[0], doubles[0].norm().float())


@pytest.mark.serial
def test_kernel_releases_the_gil(cpu_kernels: bool) -> None:
    # One long call (the same 32 MB tensor listed 40 times) while a pure-Python thread counts.
    big = torch.randn(8_000_000)
    assert_releases_the_gil(lambda: _kernel([big] * 40))
