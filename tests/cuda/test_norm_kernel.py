"""The CUDA global-norm kernel (csrc/norm/multi_tensor_norm.cu, ``torch.ops.ds_strategy.multi_tensor_l2norm``
on CUDA tensors; Python entry point ``ds_strategy.ops.multi_tensor_l2norm``) against torch.

The reference is ``torch.linalg.vector_norm`` in float64 of every element (``ds_strategy.ops.fallback``),
the same sum the CPU kernel is held to in tests/ops/test_norm.py. The GPU sums in another order (blocks,
then a tree), so the tolerance is rtol 2e-6 as there. tests/ops/test_fused_adam_cuda.py covers FusedAdam.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda.common import gpu_only, requires_gpu

pytestmark = [requires_gpu, gpu_only, pytest.mark.kernels]

SIZES = (1, 15, 17, 4097, 1_000_003)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels() -> None:
    from torch.utils.cpp_extension import CUDA_HOME

    from ds_strategy.ops import load_cuda_kernels

    if CUDA_HOME is None:
        pytest.skip("no CUDA toolkit here (nvcc / CUDA_HOME): the CUDA kernels cannot be built (docs/installation.md)")
    if not load_cuda_kernels():
        pytest.fail(f"the CUDA toolkit is at {CUDA_HOME} but the CUDA kernels did not build; see the warning above")


def _kernel(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.ds_strategy.multi_tensor_l2norm(tensors)


def _reference(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from ds_strategy.ops import fallback

    norm, found = fallback.multi_tensor_l2norm([t.cpu() for t in tensors])
    return norm, found


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_norm_matches_torch(size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(size)
    tensors = [
        torch.randn(size, generator=gen).to(dtype).cuda(),
        torch.randn(3, size % 7 + 1, generator=gen).to(dtype).cuda(),
    ]
    norm, found_inf = _kernel(tensors)
    assert norm.device.type == found_inf.device.type == "cuda"  # no host round trip
    assert norm.dtype == torch.float32 and norm.dim() == 0
    ref_norm, ref_inf = _reference(tensors)
    torch.testing.assert_close(norm.cpu(), ref_norm, rtol=2e-6, atol=0.0)
    assert found_inf.item() == ref_inf.item() == 0.0


def test_many_tensors_mixed_dtypes_and_the_python_entry_point() -> None:
    """More tensors than one launch takes, every dtype in one call; the wrapper skips empties and takes views."""
    from ds_strategy.ops import multi_tensor_l2norm

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(int(n), generator=gen).to(DTYPES[i % 3]).cuda()
        for i, n in enumerate(torch.randint(1, 3000, (200,), generator=gen))
    ]
    torch.testing.assert_close(_kernel(tensors)[0].cpu(), _reference(tensors)[0], rtol=2e-6, atol=0.0)
    base = torch.randn(64, 33, device="cuda")
    norm, found = multi_tensor_l2norm([base.t(), torch.empty(0, device="cuda"), *tensors])
    assert norm.device.type == "cuda"
    torch.testing.assert_close(norm.cpu(), _reference([base, *tensors])[0], rtol=2e-6, atol=0.0)
    assert found.item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_is_found_anywhere(dtype: torch.dtype, bad: float) -> None:
    for size in SIZES:
        for where in (0, size // 2, size - 1):
            t = torch.randn(size).to(dtype)
            t[where] = bad
            tensors = [torch.ones(5, dtype=dtype).cuda(), t.cuda()]
            assert _kernel(tensors)[1].item() == 1.0, (size, where)


def test_huge_finite_values_are_not_overflow() -> None:
    t = torch.full((33,), 3e30, device="cuda")  # the squares overflow fp32, the values do not
    norm, found_inf = _kernel([t])
    assert found_inf.item() == 0.0
    torch.testing.assert_close(norm.cpu(), torch.tensor(3e30 * 33**0.5), rtol=1e-6, atol=0)


def test_clip_grad_norm_agrees_with_torch() -> None:
    """What the engine does with it: the global norm torch's clip_grad_norm_ computes, on the GPU."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=gen).cuda() for n in (10, 4097, 123_457)]
    expected = (
        torch.nn.utils.get_total_norm(grads)
        if hasattr(torch.nn.utils, "get_total_norm")
        else torch.linalg.vector_norm(torch.cat(grads))
    )
    torch.testing.assert_close(_kernel(grads)[0], expected.float(), rtol=1e-5, atol=0)
