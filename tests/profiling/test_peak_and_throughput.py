"""The peak-flops table, its user setting, MFU arithmetic and the token-count rule."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.profiling import batch_tokens, mfu, peak_flops, set_peak_tflops, table_peak_tflops
from ds_strategy.profiling import throughput as throughput_module
from ds_strategy.profiling.throughput import SpeedMeter


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),
        ("NVIDIA H100 NVL", torch.float16, 835.5),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float32, 19.5),
        ("NVIDIA A10", torch.bfloat16, 125.0),
        ("NVIDIA A10G", torch.bfloat16, None),  # not in the table: no guess
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 on V100
        ("NVIDIA L4", torch.bfloat16, 121.0),
        ("NVIDIA L40S", torch.bfloat16, 362.05),
    ],
)
def test_table_lookup(name: str, dtype: torch.dtype, tflops: float | None) -> None:
    assert table_peak_tflops(name, dtype) == tflops


def test_cpu_has_no_peak_until_the_user_sets_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_STRATEGY_PEAK_TFLOPS", raising=False)
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    set_peak_tflops(1.5)
    try:
        assert peak_flops(torch.device("cpu"), torch.float32) == 1.5e12
    finally:
        set_peak_tflops(None)
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv("DS_STRATEGY_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="is not a number of TFLOPS"):
        peak_flops(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="the peak must be a positive number of TFLOPS"):
        set_peak_tflops(0)


def test_mfu_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 devices of 989.4 TFLOPS achieving 3.2 PFLOPS together: 40.4 % MFU
    assert mfu(3.2e15, 989.4e12, 8) == pytest.approx(3.2e15 / (8 * 989.4e12))
    clock = iter([0.0, 2.0, 3.0])
    monkeypatch.setattr(throughput_module.time, "perf_counter", lambda: next(clock))
    meter = SpeedMeter()  # t = 0
    rates = meter.read(64, 64 * 128, flops_per_sample=6e9, peak_per_device=1e12, devices=4)  # t = 2
    assert rates["samples_per_sec"] == 32.0
    assert rates["tokens_per_sec"] == 32.0 * 128
    assert rates["tflops"] == pytest.approx(32.0 * 6e9 / 1e12)
    assert rates["mfu"] == pytest.approx(32.0 * 6e9 / 4e12)
    rates = meter.read(96, 96 * 128)  # t = 3: 32 samples in 1 s, nothing known about flops
    assert rates == {"samples_per_sec": 32.0, "tokens_per_sec": 32.0 * 128}


def test_batch_tokens_rule() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)
    x = torch.randn(4, 3)
    assert batch_tokens((x, ids), {}) == 64  # the first integer tensor, floats skipped
    assert batch_tokens((), {"input_ids": ids, "attention_mask": torch.ones(4, 9, dtype=torch.long)}) == 64
    assert batch_tokens(({"batch": [x, ids[:, :5]]}, 3), {}) == 20  # nested; a Python int is no tensor
    assert batch_tokens((x, torch.ones(4, dtype=torch.bool)), {}) is None  # masks of bools are not tokens
