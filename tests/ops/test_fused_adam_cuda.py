"""The CUDA Adam kernel against the CPU kernel (same math header: bitwise equal). Runs where torch has CUDA
and a GPU; on CPU-only machines tests/ops/test_cuda_sources.py still compiles the sources."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.ops import FusedAdam, fused_adam_step, load_cuda_kernels

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def cuda_kernels() -> bool:
    if not load_cuda_kernels():
        pytest.fail("CUDA is available but the CUDA kernels did not build")
    return True


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_step_equals_cpu_step_bitwise(cuda_kernels: bool, grad_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 17, 4097, 1_000_003] + [33] * 30  # more tensors than one launch holds
    params = [torch.randn(n, generator=gen) for n in sizes]
    exp_avgs = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    exp_avg_sqs = [torch.rand(n, generator=gen) * 0.01 for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 8).to(grad_dtype) for n in sizes]
    cpu = (params, exp_avgs, exp_avg_sqs, [torch.empty(n, dtype=torch.bfloat16) for n in sizes])
    gpu = tuple([t.cuda() for t in ts] for ts in cpu)
    gpu_grads = [g.cuda() for g in grads]
    for step, adamw_mode in ((1, True), (2, False), (3, True)):
        kw = dict(step=step, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode, grad_scale=8.0, clip_coef=0.5)
        fused_adam_step(cpu[0], grads, cpu[1], cpu[2], out_16bit=cpu[3], **kw)
        fused_adam_step(gpu[0], gpu_grads, gpu[1], gpu[2], out_16bit=gpu[3], **kw)
    # Same math header, no contraction on either side: bit for bit.
    for ts_cpu, ts_gpu in zip(cpu, gpu, strict=True):
        for a, b in zip(ts_cpu, ts_gpu, strict=True):
            assert torch.equal(a, b.cpu())


def test_cuda_skip_writes_nothing_and_needs_no_sync(cuda_kernels: bool) -> None:
    p, g, m, v = (torch.randn(5000, device="cuda") for _ in range(4))
    v.abs_()
    g[4999] = float("nan")
    before = (p.clone(), m.clone(), v.clone())
    found = fused_adam_step(p, g, m, v, step=1, lr=1e-2, skip_if_nonfinite=True)
    assert found.device.type == "cuda" and found.item() == 1.0
    assert torch.equal(p, before[0]) and torch.equal(m, before[1]) and torch.equal(v, before[2])


def test_fused_adam_class_matches_torch_adamw_on_cuda(cuda_kernels: bool) -> None:
    a = torch.nn.Parameter(torch.randn(4097, device="cuda"))
    b = torch.nn.Parameter(a.detach().clone())
    ours, ref = FusedAdam([a], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(20):
        g = torch.randn(4097, device="cuda")
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
