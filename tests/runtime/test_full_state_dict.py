"""The engine's full-state-dict contract (issues 17 and 19): ``full_state_dict(rank)`` assembles the module's
weights on one rank's CPU, ``load_full_state_dict(sd)`` writes a plain state dict into any stage, and
``destroy()`` at stage 3 hands each rank's shards back as zero.Init leaves them, ready for a new engine.
Reference: the plain module's own state dict (exact: fp32 copies in and out)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_strategy.runtime.counters import StepCounters
from tests.harness import run_distributed
from tests.runtime.common import config, engine_run, make_tied, token_batches


def _cfg(stage: int) -> dict[str, Any]:
    cfg = config(stage=stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    return cfg


def _roundtrip(rank: int, world: int, stage: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt
    from ds_strategy.zero import GatheredParameters

    out: dict[str, Any] = {}
    source = make_tied(seed=3).state_dict()
    engine, _, _, _ = rt.initialize(model=make_tied(seed=0), config=_cfg(stage))
    engine.load_full_state_dict(source)
    got = engine.full_state_dict(rank=0)
    out["on_rank0"] = {k: v.clone() for k, v in got.items()}
    everywhere = engine.full_state_dict(rank=None)
    out["everywhere"] = sorted(everywhere)
    with pytest.raises(Exception, match="does not match the model: missing keys"):
        engine.load_full_state_dict({k: v for k, v in source.items() if k != "ln.weight"})
    engine.load_full_state_dict({"ln.weight": torch.full_like(source["ln.weight"], 2.0)}, strict=False)
    with GatheredParameters([engine.module.ln.weight]):
        out["partial"] = engine.module.ln.weight.detach().clone()
    # Train a little, release the engine, build a new one from the handed-back module: same weights.
    engine_run(engine, token_batches(2, 2 * 2 * world), micro=2, gas=2)
    before = engine.full_state_dict(rank=None)
    module = engine.module
    engine.destroy()
    with GatheredParameters(list(module.parameters())):
        out["after_destroy"] = all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    again, _, _, _ = rt.initialize(model=module, config=_cfg(stage))
    out["rebuilt"] = all(torch.equal(v, before[k]) for k, v in again.full_state_dict(rank=None).items())
    again.destroy()
    return {"source": source, **out}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_full_state_dict_round_trip_and_hand_back(stage: int) -> None:
    runs = run_distributed(_roundtrip, world_size=2, args=(stage,))
    source = runs[0]["source"]
    got = runs[0]["on_rank0"]
    assert got.keys() == source.keys()
    for k, v in source.items():
        assert torch.equal(got[k], v), k
    assert runs[1]["on_rank0"] == {}  # assembled on rank 0 only
    for r in runs:
        assert r["everywhere"] == sorted(source)
        assert torch.equal(r["partial"], torch.full_like(source["ln.weight"], 2.0))
        assert r["after_destroy"] and r["rebuilt"]


def test_step_counters_round_trip_and_refuse_a_partial_state() -> None:
    c = StepCounters(micro_steps=8, global_steps=4, global_samples=64, skipped_steps=1)
    d = StepCounters()
    d.load_state_dict(c.state_dict())
    assert d == c
    with pytest.raises(KeyError, match="skipped_steps"):
        d.load_state_dict({"micro_steps": 1, "global_steps": 1, "global_samples": 1})
