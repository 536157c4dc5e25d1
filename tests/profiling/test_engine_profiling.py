"""The engine's flops_profiler block, tokens/s and MFU (issue 23, criterion 2), on 1 process and under
ZeRO stage 3 on 2 ranks (counts see the gathered shapes, parameters count at full size)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

pytestmark = pytest.mark.multiprocess

VOCAB, D, SEQ, MICRO = 32, 16, 6, 2


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.fc2(torch.relu(self.fc1(self.emb(ids)))))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


FWD_FLOPS = 2 * MICRO * SEQ * (D * 4 * D + 4 * D * D + D * VOCAB)  # the three Linears (embedding: no flops)
PARAMS = VOCAB * D + (D * 4 * D + 4 * D) + (4 * D * D + D) + (D * VOCAB + VOCAB)


def _config(tmp: str, **profiler: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{tmp}/profile.txt", **profiler},
    }


def _train(engine: Any, steps: int, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        loss = engine(torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
        engine.backward(loss)
        engine.step()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _one_process(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.profiling import set_peak_tflops

    set_peak_tflops(2.0)
    handler = _Lines()
    logging.getLogger("ds_strategy").addHandler(handler)
    try:
        torch.manual_seed(0)
        model = TinyLM()
        cfg = _config(tmp, recompute_fwd_factor=1.0, profile_step=2)
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        _train(engine, 2)
        early = {"file": Path(tmp, "profile.txt").exists(), "throughput": engine.throughput}
        _train(engine, 2)
        out = {
            "early": early,
            "last_profile": dict(engine.profiling.last_profile),
            "started": engine.flops_profiler is not None and engine.flops_profiler.started,
            "flops_per_sample": engine.profiling.flops_per_sample,
            "throughput": engine.throughput,
            "lines": [line for line in handler.lines if "samples/sec=" in line],
        }
        engine.destroy()
        return out
    finally:
        logging.getLogger("ds_strategy").removeHandler(handler)
        set_peak_tflops(None)


def test_profile_at_profile_step_throughput_and_mfu(tmp_path: Path) -> None:
    from ds_strategy.profiling.units import number_to_string

    (got,) = run_distributed(_one_process, 1, args=(str(tmp_path),), timeout=120)
    assert not got["early"]["file"]  # steps 0 and 1 are not profile_step
    assert "tflops" not in got["early"]["throughput"]
    text = (tmp_path / "profile.txt").read_text()
    assert "Flops profile at step 2" in text
    assert number_to_string(FWD_FLOPS) in text
    assert got["last_profile"]["flops"] == FWD_FLOPS
    assert got["last_profile"]["params"] == PARAMS
    assert not got["started"]  # the profile ended after printing
    # a step costs (3 + recompute_fwd_factor) forwards
    assert got["flops_per_sample"] == pytest.approx(4.0 * FWD_FLOPS / MICRO)
    rates = got["throughput"]
    assert rates["tokens_per_sec"] == pytest.approx(SEQ * rates["samples_per_sec"])
    assert rates["tflops"] == pytest.approx(rates["samples_per_sec"] * 4.0 * FWD_FLOPS / MICRO / 1e12)
    assert rates["mfu"] == pytest.approx(rates["tflops"] / 2.0)  # one device of 2 TFLOPS
    lines = got["lines"]
    assert len(lines) == 2
    assert "tokens/sec=" in lines[0] and "MFU" not in lines[0]  # step 2's line: flops not known yet
    assert "tokens/sec=" in lines[1] and "MFU=" in lines[1] and "TFLOPS=" in lines[1]


def _disabled(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    model = nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    out = {"profiler": engine.flops_profiler, "keys": set(engine.throughput)}
    engine.destroy()
    return out


def test_disabled_profiler_and_no_integer_input() -> None:
    (got,) = run_distributed(_disabled, 1, timeout=120)
    assert got["profiler"] is None
    assert got["keys"] == {"samples_per_sec"}  # no token count, no flops


def _stage3(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import ds_strategy

    torch.manual_seed(0)
    model = TinyLM()
    cfg = _config(tmp)
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    at_rest = sum(p.numel() for p in model.parameters())
    _train(engine, 3, rank)
    out = {"at_rest": at_rest, "profile": dict(engine.profiling.last_profile)}
    engine.destroy()
    return out


def test_stage3_counts_the_gathered_model(tmp_path: Path) -> None:
    results = run_distributed(_stage3, 2, args=(str(tmp_path),), timeout=120)
    assert results[0]["at_rest"] < PARAMS  # the parameters really are partitioned between forwards
    assert results[0]["profile"]["flops"] == FWD_FLOPS
    assert results[0]["profile"]["macs"] == FWD_FLOPS // 2
    assert results[0]["profile"]["params"] == PARAMS
    assert results[1]["profile"] == {}  # rank 0 profiles, as in DeepSpeed
    assert "Flops profile at step 1" in (tmp_path / "profile.txt").read_text()
