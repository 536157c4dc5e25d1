"""The engine's full-state-dict contract (issues 17 and 19): ``full_state_dict(rank)`` assembles the module's
weights on one rank's CPU, ``load_full_state_dict(sd)`` writes a plain state dict into any stage, and
``destroy()`` at stage 3 hands each rank's shards back as zero.Init leaves them, ready for a new engine.
Reference: the plain module's own state dict (exact: fp32 copies in and out)."""

from __future__ import annotations

import copy
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


# ---- a plain torch optimizer's state into the partitions (engine.load_full_optimizer_state) ---------------


class _Mlp(torch.nn.Module):
    """Every parameter used (torch's AdamW skips a gradient-less one, a flat master cannot), plus a
    never-used Linear in its own param group: the saving run never stepped it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(x), y)


def _mlp_groups(model: _Mlp) -> list[dict[str, Any]]:
    return [
        {"params": list(model.body.parameters()), "weight_decay": 0.1},
        {"params": list(model.unused.parameters()), "weight_decay": 0.0},
    ]


def _mlp_data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


def _plain_run() -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """Two AdamW steps (then the saved weights and optimizer state), two more (the reference)."""
    torch.manual_seed(0)
    model = _Mlp()
    opt = torch.optim.AdamW(_mlp_groups(model), lr=1e-2)
    saved: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    for i, (x, y) in enumerate(_mlp_data(4)):
        if i == 2:
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return saved[0], saved[1], model.state_dict()


def _import(rank: int, world: int, stage: int, client: bool, offload: bool) -> dict[str, torch.Tensor]:
    import ds_strategy.runtime as rt

    weights, opt_state, _ = _plain_run()
    torch.manual_seed(1)
    model = _Mlp()
    cfg = config(stage=stage, micro=2, gas=1, offload=offload)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if client:
        del cfg["optimizer"]
        engine, *_ = rt.initialize(model=model, optimizer=torch.optim.AdamW(_mlp_groups(model), lr=0.5), config=cfg)
    else:  # the config's AdamW (the C++ kernel on CPU) over the same groups
        engine, *_ = rt.initialize(model=model, model_parameters=_mlp_groups(model), config=cfg)
    engine.load_full_state_dict(weights)
    engine.load_full_optimizer_state(opt_state)
    for x, y in _mlp_data(4)[2:]:
        engine.backward(engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]))
        engine.step()
    out = engine.full_state_dict(rank=None)
    engine.destroy()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "client", "offload"),
    [(1, True, False), (2, False, False), (3, True, False), (3, False, True)],
    ids=["stage1-client", "stage2-config", "stage3-client", "stage3-offload"],
)
def test_a_plain_optimizer_state_continues_exactly(stage: int, client: bool, offload: bool) -> None:
    """The weights and AdamW moments of a single-process run after 2 steps, loaded into 2 ranks: the next 2
    steps land where the single process lands (the moments continue; fresh ones would not)."""
    _, _, reference = _plain_run()
    for got in run_distributed(_import, world_size=2, args=(stage, client, offload)):
        for k, v in reference.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6, msg=k)


def _other_groups(rank: int, world: int) -> str:
    import ds_strategy.runtime as rt

    _, opt_state, _ = _plain_run()
    engine, *_ = rt.initialize(model=_Mlp(), config=config(stage=2, micro=4, gas=1))  # one group
    try:
        engine.load_full_optimizer_state(opt_state)
    except Exception as err:
        return str(err)
    finally:
        engine.destroy()
    return ""


def test_a_plain_optimizer_state_from_other_groups_is_refused() -> None:
    (text,) = run_distributed(_other_groups, world_size=1)
    assert "has param groups of [4, 2] parameters, the optimizer this engine was given has [6]" in text, text
