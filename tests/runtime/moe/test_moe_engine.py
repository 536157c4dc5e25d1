"""Expert parallelism through the engine on 2 and 4 processes against one process holding every expert.

The distributed run: ``ds_strategy.initialize`` on a model whose MoE layer has ``ep_size`` (each rank holds
``NUM_EXPERTS / ep_size`` experts, tokens travel by all-to-all), ZeRO stage 0, 1 or 2, AdamW from the
config and gradient clipping small enough to act. The reference: one process with all experts, the same
global batch, each rank's chunk gated on its own (the gate's capacity and aux loss are per rank), the
mean of the chunks' losses, ``clip_grad_norm_`` and ``torch.optim.AdamW``. Capacity is large enough that
no token drops. Tolerances (fp32): losses, norms and weights rtol 2e-5 / atol 2e-6 after 3 steps
(reductions sum in another order); expert counts exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import ds_strategy
from ds_strategy.moe import split_params_into_different_moe_groups_for_optimizer
from tests.harness import run_distributed
from tests.runtime.moe.common import NUM_EXPERTS, data, full_model, local_model, local_view, reference_run

MICRO = 2
STEPS = 3
LR = 1e-2
CLIP = 0.05  # below the gradient norm of every step: clipping acts
TOL = {"rtol": 2e-5, "atol": 2e-6}


# Variants beside plain fp32: the optimizer offloaded to the host (fp32 master and Adam state in host
# memory, the compiled CPU Adam: the same arithmetic, so the same tolerances), and bf16 (the model computes
# in bf16 against the fp32 reference, fp32 masters: a bf16 forward's relative error, ~3 significant digits).
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, float]]] = {
    "fp32": ({}, TOL),
    "offload": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, TOL),
    "bf16": ({"bf16": {"enabled": True}}, {"rtol": 3e-2, "atol": 3e-3}),
}


def _config(stage: int, variant: str = "fp32") -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "gradient_clipping": CLIP,
    }
    extra, _ = VARIANTS[variant]
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def _body(
    rank: int, world: int, ep_size: int, stage: int, k: int, drop_tokens: bool, variant: str = "fp32"
) -> dict[str, Any]:
    tol = VARIANTS[variant][1]
    kw = {"k": k, "drop_tokens": drop_tokens}
    full = full_model(**kw)
    batches = data(STEPS, MICRO * world)
    ref = reference_run(full, batches, world, LR, CLIP)
    ep_rank = rank % ep_size
    model = local_model(full, ep_size, ep_rank, **kw)
    engine, *_ = ds_strategy.initialize(model=model, config=_config(stage, variant))
    assert engine.has_moe_layers and engine.num_experts == [NUM_EXPERTS] and len(engine.gate_modules) == 1
    losses, aux, counts, norms = [], [], [], []
    for x, y in batches:
        xs, ys = x.chunk(world), y.chunk(world)
        loss, l_aux, c = engine(xs[rank], ys[rank])
        loss, l_aux = loss.float(), l_aux.float()
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        aux.append(float(l_aux))
        counts.append(c.tolist())
        norms.append(engine.get_global_grad_norm())
    for got, want in zip(losses, ref["losses"], strict=True):
        assert got == pytest.approx(want, rel=tol["rtol"], abs=tol["atol"])
    for got, want in zip(norms, ref["norms"], strict=True):
        assert got == pytest.approx(want, rel=tol["rtol"], abs=tol["atol"])
        assert want > CLIP
    for s in range(STEPS):
        assert aux[s] == pytest.approx(ref["aux"][s][rank], rel=tol["rtol"], abs=tol["atol"])
        assert counts[s] == ref["counts"][s][rank]
    want_state = local_view(ref["state"], ep_size, ep_rank)
    got_state = engine.module.state_dict()
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        got = got_state[name].float()
        if variant == "bf16":
            # Adam divides by the gradient's own scale: where a gradient is near zero, bf16 can flip its
            # sign and with it a whole update (up to 2 * LR a step). Nearly every element stays within
            # the bf16 tolerance; none moves further than such flipped updates could take it.
            off = (got - value).abs() > tol["atol"] + tol["rtol"] * value.abs()
            assert off.float().mean() <= 0.03, f"{name}: {int(off.sum())} of {off.numel()} elements off"
            assert (got - value).abs().max() <= 2 * LR * STEPS, name
            continue
        torch.testing.assert_close(got, value, **tol, msg=lambda m, n=name: f"{n}: {m}")
    expert_numel = sum(p.numel() for p in engine.module.moe.deepspeed_moe.experts.parameters())
    total_expert_numel = sum(p.numel() for p in full.moe.deepspeed_moe.experts.parameters())
    engine.destroy()
    return {"expert_numel": expert_numel, "total": total_expert_numel}


CASES = [
    # (world, ep_size, stage, k, drop_tokens)
    (2, 2, 0, 1, True),
    (2, 2, 1, 2, True),
    (2, 2, 2, 1, False),
    (2, 1, 2, 2, True),
    (4, 2, 2, 1, True),
    (4, 4, 1, 2, False),
    (4, 2, 0, 2, True),
]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep_size", "stage", "k", "drop_tokens"), CASES)
def test_expert_parallel_matches_single_process(
    world: int, ep_size: int, stage: int, k: int, drop_tokens: bool
) -> None:
    results = run_distributed(_body, world_size=world, args=(ep_size, stage, k, drop_tokens), timeout=240)
    for r in results:
        # each rank holds only its experts: 1 / ep_size of them (measured on the module)
        assert r["expert_numel"] * ep_size == r["total"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["offload", "bf16"])
def test_expert_parallel_offload_and_bf16_match_single_process(variant: str) -> None:
    """Experts split over 2 ranks at stage 2 with the optimizer on the host, or computing in bf16, train as
    the fp32 single process does (bf16 within its stated tolerance)."""
    results = run_distributed(_body, world_size=2, args=(2, 2, 2, True, variant), timeout=240)
    assert all(r["expert_numel"] * 2 == r["total"] for r in results)


def _client_optimizer_body(rank: int, world: int) -> str:
    model = local_model(full_model(), 2, rank % 2)
    mixed = torch.optim.AdamW(model.parameters(), lr=LR)
    try:
        ds_strategy.initialize(model=model, optimizer=mixed, config=_config(1))
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("a client optimizer mixing dense and expert parameters was accepted")
    split = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
    engine, *_ = ds_strategy.initialize(model=model, optimizer=torch.optim.AdamW(split, lr=LR), config=_config(1))
    assert [g.get("moe", False) for g in engine.optimizer.param_groups] == [False, True]
    engine.destroy()
    return message


@pytest.mark.multiprocess
def test_client_optimizer_must_split_groups() -> None:
    messages = run_distributed(_client_optimizer_body, world_size=2, timeout=120)
    assert "split_params_into_different_moe_groups_for_optimizer" in messages[0]
    assert "param group 0 mixes dense parameters and expert parameters" in messages[0]


def _stage3_body(rank: int, world: int) -> str:
    model = local_model(full_model(), 2, rank % 2)
    try:
        ds_strategy.initialize(model=model, config=_config(3))
    except ValueError as e:
        return str(e)
    raise AssertionError("stage 3 with MoE was accepted")


@pytest.mark.multiprocess
def test_stage3_with_moe_is_refused() -> None:
    assert all("stage 3 with MoE layers" in m for m in run_distributed(_stage3_body, world_size=2))
