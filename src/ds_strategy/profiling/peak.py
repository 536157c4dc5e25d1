"""Peak dense flops per device, for MFU (model flops utilisation = achieved flops/s / peak flops/s).

The table holds vendor datasheet figures for dense math (no 2:4 sparsity): bf16 and fp16 on the tensor
cores, fp32 on the CUDA cores (TF32 tensor-core math is opt-in in torch). A device not in the table, and
CPUs, have no peak: MFU is then not shown, unless ``DS_STRATEGY_PEAK_TFLOPS`` (per device, in TFLOPS) or
``set_peak_tflops(...)`` says it.
"""

from __future__ import annotations

import os
import re

import torch

from ds_strategy import env

PEAK_TFLOPS = env.PEAK_TFLOPS

# (pattern in torch.cuda.get_device_name, label, {dtype: dense TFLOPS}); the first match wins, so the
# more specific names come first ("H100 NVL" before "H100").
PEAK_TABLE: tuple[tuple[str, str, dict[torch.dtype, float]], ...] = (
    (r"H200 NVL", "H200 NVL", {torch.bfloat16: 835.5, torch.float16: 835.5, torch.float32: 60.0}),
    (r"H200", "H200 SXM", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9}),
    (r"H100 NVL", "H100 NVL", {torch.bfloat16: 835.5, torch.float16: 835.5, torch.float32: 60.0}),
    (r"H100 PCIe", "H100 PCIe", {torch.bfloat16: 756.5, torch.float16: 756.5, torch.float32: 51.2}),
    (r"H100", "H100 SXM", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9}),
    (r"A100", "A100 (SXM and PCIe)", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5}),
    (r"L40S", "L40S", {torch.bfloat16: 362.05, torch.float16: 362.05, torch.float32: 91.6}),
    (r"\bL4\b", "L4", {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3}),
    (r"\bA10\b", "A10", {torch.bfloat16: 125.0, torch.float16: 125.0, torch.float32: 31.2}),
    (r"V100", "V100 SXM2", {torch.float16: 125.0, torch.float32: 15.7}),
)


def set_peak_tflops(tflops: float | None) -> None:
    """Set (None: clear) the peak of one device in TFLOPS, used instead of the table.

    It is stored in ``DS_STRATEGY_PEAK_TFLOPS`` so that processes started afterwards (Lightning's
    launcher, ``ds-launch``) see it too."""
    if tflops is None:
        os.environ.pop(PEAK_TFLOPS, None)
    elif not tflops > 0:
        raise ValueError(f"set_peak_tflops: the peak must be a positive number of TFLOPS, got {tflops!r}")
    else:
        os.environ[PEAK_TFLOPS] = repr(float(tflops))


def table_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The table's dense peak of ``device_name`` (as torch.cuda.get_device_name says it) for ``dtype``."""
    for pattern, _, peaks in PEAK_TABLE:
        if re.search(pattern, device_name):
            return peaks.get(dtype)
    return None


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak flops per second of one ``device`` computing in ``dtype``: the user's setting, else the table."""
    raw = env.get(PEAK_TFLOPS)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{PEAK_TFLOPS}={raw!r} is not a number of TFLOPS") from None
        return value * 1e12 if value > 0 else None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    tflops = table_peak_tflops(torch.cuda.get_device_name(device), dtype)
    return None if tflops is None else tflops * 1e12


def mfu(flops_per_second: float, peak_per_device: float, devices: int) -> float:
    """Model flops utilisation: achieved flops/s over the peak of all ``devices`` together."""
    return flops_per_second / (peak_per_device * devices)
