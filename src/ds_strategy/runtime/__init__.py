"""The training engine: ZeRO stages 0-3 (zero/), precision, loss scaling, lr schedules, optimizer and
parameter offload (to the CPU: zero/offload.py; to NVMe: swap/), checkpoints (checkpoint/), and what
``initialize`` builds around it: the pipeline engine (pipe/), MoE layers (moe/), ZeRO++ (zero/zeropp.py),
the hybrid engine's ``generate`` (hybrid.py, inference_tp.py).

Knows nothing of Lightning; the Lightning adapter and plain PyTorch loops drive the same ``ZeroEngine``.
"""

from __future__ import annotations

from .engine import ZeroEngine
from .initialize import build_dataloader, initialize
from .layout import FlatLayout
from .loss_scaler import LossScaleError, LossScaler
from .lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler
from .memory import (
    MemoryEstimate,
    estimate_memory,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_live,
)
from .muon import MuonWithAuxAdam
from .optimizers import Lion, build_optimizer

__all__ = [
    "FlatLayout",
    "LRRangeTest",
    "Lion",
    "LossScaleError",
    "LossScaler",
    "MemoryEstimate",
    "MuonWithAuxAdam",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroEngine",
    "build_dataloader",
    "build_optimizer",
    "build_scheduler",
    "estimate_memory",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_live",
    "initialize",
]
