"""estimate_memory against the bytes the engine actually allocates; ZeRO's 1/N savings measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_strategy.runtime.memory import estimate_memory
from tests.harness import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 128))


COMBOS = [(0, "fp32", False), (0, "bf16", False)] + [
    (stage, precision, offload) for stage in (1, 2) for precision in ("fp32", "bf16") for offload in (False, True)
]


def _measure(rank: int, world: int) -> list[dict[str, Any]]:
    import ds_strategy.runtime as rt

    out = []
    for stage, precision, offload in COMBOS:
        model = _model()
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}},
        }
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine, _, _, _ = rt.initialize(model=model, config=cfg)
        x = torch.randn(4, 256)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        out.append({"combo": (stage, precision, offload), "measured": engine.memory_breakdown()})
        engine.destroy()
    return out


@pytest.mark.multiprocess
def test_estimate_matches_measured_bytes_and_zero_divides_by_n() -> None:
    measured = {r["combo"]: r["measured"] for r in run_distributed(_measure, world_size=2)[0]}
    for (stage, precision, offload), got in measured.items():
        expected = estimate_memory(_model(), 2, stage, offload, precision, device="cpu").as_dict()
        for kind, value in expected.items():
            if value == 0:
                assert got[kind] == 0, (stage, precision, offload, kind, got)
            else:
                assert abs(got[kind] - value) <= 0.1 * value, (stage, precision, offload, kind, got[kind], value)
    # Stage 1 partitions the optimizer state, stage 2 the gradients too: measured at ~1/N (N = 2).
    full_state = measured[(0, "fp32", False)]["optimizer_state"]
    assert measured[(1, "fp32", False)]["optimizer_state"] == pytest.approx(full_state / 2, rel=0.01)
    full_grads = measured[(0, "bf16", False)]["grads"]
    assert measured[(2, "bf16", False)]["grads"] == pytest.approx(full_grads / 2, rel=0.01)
    # bf16 stage 1/2: fp32 masters 1/N; fp32 without offload: the master is the parameter buffer itself
    assert measured[(1, "fp32", False)]["master"] == 0
    assert measured[(1, "bf16", False)]["master"] == pytest.approx(measured[(0, "bf16", False)]["master"] / 2, rel=0.01)


def test_estimate_arithmetic() -> None:
    n = 1_000_000
    est = estimate_memory(n, 4, 2, True, "bf16")  # GPU-style: offloaded masters are separate copies
    assert est.params == 2 * n and est.grads == n and est.master == n and est.optimizer_state == 2 * n
    assert est.offloaded == 3 * n and est.on_device == 3 * n and est.total == 6 * n
    assert estimate_memory(n, 4, 0, False, "fp32").as_dict() == {
        "params": 4 * n,
        "grads": 4 * n,
        "master": 0,
        "optimizer_state": 8 * n,
    }
    assert estimate_memory(n, 2, 1, False, "fp16", optimizer="SGD").optimizer_state == 2 * n
    with pytest.raises(ValueError, match="offload needs ZeRO stage 1, 2 or 3"):
        estimate_memory(n, 2, 0, True, "fp32")
    with pytest.raises(ValueError, match="precision"):
        estimate_memory(n, 2, 1, False, "fp8")
