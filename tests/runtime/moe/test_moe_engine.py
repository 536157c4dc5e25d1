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


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "gradient_clipping": CLIP,
    }


def _body(rank: int, world: int, ep_size: int, stage: int, k: int, drop_tokens: bool) -> dict[str, Any]:
    kw = {"k": k, "drop_tokens": drop_tokens}
    full = full_model(**kw)
    batches = data(STEPS, MICRO * world)
    ref = reference_run(full, batches, world, LR, CLIP)
    ep_rank = rank % ep_size
    model = local_model(full, ep_size, ep_rank, **kw)
    engine, *_ = ds_strategy.initialize(model=model, config=_config(stage))
    assert engine.has_moe_layers and engine.num_experts == [NUM_EXPERTS] and len(engine.gate_modules) == 1
    losses, aux, counts, norms = [], [], [], []
    for x, y in batches:
        xs, ys = x.chunk(world), y.chunk(world)
        loss, l_aux, c = engine(xs[rank], ys[rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        aux.append(float(l_aux))
        counts.append(c.tolist())
        norms.append(engine.get_global_grad_norm())
    for got, want in zip(losses, ref["losses"], strict=True):
        assert got == pytest.approx(want, rel=TOL["rtol"], abs=TOL["atol"])
    for got, want in zip(norms, ref["norms"], strict=True):
        assert got == pytest.approx(want, rel=TOL["rtol"], abs=TOL["atol"])
        assert want > CLIP
    for s in range(STEPS):
        assert aux[s] == pytest.approx(ref["aux"][s][rank], rel=TOL["rtol"], abs=TOL["atol"])
        assert counts[s] == ref["counts"][s][rank]
    want_state = local_view(ref["state"], ep_size, ep_rank)
    got_state = engine.module.state_dict()
    assert set(got_state) == set(want_state)
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name].float(), value, **TOL, msg=lambda m, n=name: f"{n}: {m}")
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
