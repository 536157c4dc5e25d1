"""Full-state access (``ds_strategy.utils.safe_get_*`` / ``safe_set_*``, DeepSpeed's ``deepspeed.utils``
functions) on 2 ranks at stages 0-3, optimizer offload included (issue 21, criterion 4).

The reference is single-process torch: the same model and AdamW on the global batch (2 micro-batches of 3
rows per rank per step, accumulation 2, so 12 rows per step). At every step, after the boundary backward:
the full gradient equals the reference's ``p.grad`` (averaged, unscaled), and every rank's local fragment,
concatenated in rank order, equals the flattened full value (at stage 0 each rank's is the whole value);
after each step the full fp32 weights and
AdamW's ``exp_avg`` / ``exp_avg_sq`` equal torch's. Then the setters: a weight, a gradient (scaled by 3
through ``safe_update_full_grad_vectorized`` and by -1 through ``safe_set_full_grad``) and an optimizer state
are set on the engine and on the reference alike, one more step is taken, and the weights still agree. The
bucket size (25 elements) cuts parameters across the ranks' shards, so fragments are partial and some empty.
Tolerances (fp32): rtol 1e-5, atol 1e-6 - the ranks' bucketed reduction rounds in other places than torch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

CASES = [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]
STEPS, MICRO, ACC, LR = 3, 3, 2, 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = MICRO * ACC * world
    return [(torch.randn(rows, 5, generator=g), torch.randn(rows, 3, generator=g)) for _ in range(STEPS + 1)]


def _config(stage: int, offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 25, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACC,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
    }


def _micro_batches(x: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    # Rank r's micro-batch k: rows [(k * world + r) * MICRO, ...): every rank sees a disjoint share.
    return [x[(k * world + rank) * MICRO : (k * world + rank + 1) * MICRO] for k in range(ACC)]


def _one(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import ds_strategy
    from ds_strategy import utils

    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    engine, *_ = ds_strategy.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, offload)
    )
    names = [n for n, _ in model.named_parameters()]
    params, ref_params = list(model.parameters()), list(ref.parameters())
    out: dict[str, Any] = {"grads": [], "ref_grads": [], "weights": [], "ref_weights": [], "states": [],
                           "ref_states": [], "locals_ok": []}  # fmt: skip

    def check_locals(getter: Any, full: list[torch.Tensor]) -> None:
        for p, f in zip(params, full, strict=True):
            pieces: list[Any] = [None] * world
            dist.all_gather_object(pieces, getter(p))
            if stage == 0:  # nothing is partitioned: every rank's fragment is the whole parameter
                out["locals_ok"].append(all(torch.equal(piece, f.reshape(-1)) for piece in pieces))
            else:
                out["locals_ok"].append(torch.equal(torch.cat(pieces), f.reshape(-1)))

    data = _data(world)
    for step in range(STEPS + 1):
        x, y = data[step]
        for k, (xs, ys) in enumerate(zip(_micro_batches(x, rank, world), _micro_batches(y, rank, world), strict=True)):
            engine.backward(nn.functional.mse_loss(engine(xs), ys))
            if k < ACC - 1:
                engine.step()  # DeepSpeed's loop: step() after every micro-batch, the optimizer at the boundary
        ref_loss = sum(
            nn.functional.mse_loss(ref(xs), ys)
            for xs, ys in zip(x.chunk(ACC * world), y.chunk(ACC * world), strict=True)
        )
        (ref_loss / (ACC * world)).backward()
        grads = [utils.safe_get_full_grad(p) for p in params]
        out["grads"].append(grads)
        out["ref_grads"].append([p.grad.clone() for p in ref_params])
        check_locals(utils.safe_get_local_grad, grads)
        if step == STEPS:  # the setters, on the engine and on the reference alike
            utils.safe_update_full_grad_vectorized(params[:2], lambda g, p: g * 3)
            utils.safe_set_full_grad(params[3], -utils.safe_get_full_grad(params[3]))
            new_w = torch.linspace(-1, 1, 21).view(3, 7)
            utils.safe_set_full_fp32_param(params[2], new_w)
            avg = utils.safe_get_full_optimizer_state(params[0], "exp_avg")
            utils.safe_set_full_optimizer_state(params[0], avg * 0.5, "exp_avg")
            with torch.no_grad():
                ref_params[0].grad.mul_(3)
                ref_params[1].grad.mul_(3)
                ref_params[3].grad.neg_()
                ref_params[2].copy_(new_w)
                opt.state[ref_params[0]]["exp_avg"].mul_(0.5)
            out["set_weight"] = utils.safe_get_full_fp32_param(params[2])
            out["new_w"] = new_w
        engine.step()
        opt.step()
        opt.zero_grad()
        weights = [utils.safe_get_full_fp32_param(p) for p in params]
        out["weights"].append(weights)
        out["ref_weights"].append([p.detach().clone() for p in ref_params])
        check_locals(utils.safe_get_local_fp32_param, weights)
        states = [[utils.safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")] for p in params]
        out["states"].append(states)
        out["ref_states"].append([[opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")] for p in ref_params])
        check_locals(lambda p: utils.safe_get_local_optimizer_state(p, "exp_avg"), [s[0] for s in states])
    # A local setter round-trips (this rank's fragment only), and a frozen / foreign tensor gives None.
    local = utils.safe_get_local_fp32_param(params[0])
    utils.safe_set_local_fp32_param(params[0], local + 1)
    out["local_roundtrip"] = torch.equal(utils.safe_get_local_fp32_param(params[0]), local + 1)
    out["foreign"] = utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2)))
    out["names"] = names
    engine.destroy()
    out["after_destroy"] = utils.safe_get_full_fp32_param(params[0])
    return out


def _all(rank: int, world: int) -> dict[Any, Any]:
    return {case: _one(rank, world, *case) for case in CASES}


@pytest.mark.multiprocess
def test_safe_get_and_set_equal_torch_at_every_stage() -> None:
    tol = {"rtol": 1e-5, "atol": 1e-6}
    for rank_result in run_distributed(_all, world_size=2, timeout=300):
        for case, r in rank_result.items():
            for step in range(STEPS + 1):
                for got, ref, n in zip(r["grads"][step], r["ref_grads"][step], r["names"], strict=True):
                    torch.testing.assert_close(got, ref, **tol, msg=f"{case} step {step} grad {n}")
                for got, ref, n in zip(r["weights"][step], r["ref_weights"][step], r["names"], strict=True):
                    torch.testing.assert_close(got, ref, **tol, msg=f"{case} step {step} weight {n}")
                for got, ref, n in zip(r["states"][step], r["ref_states"][step], r["names"], strict=True):
                    torch.testing.assert_close(got[0], ref[0], **tol, msg=f"{case} step {step} exp_avg {n}")
                    torch.testing.assert_close(got[1], ref[1], **tol, msg=f"{case} step {step} exp_avg_sq {n}")
            assert all(r["locals_ok"]) and len(r["locals_ok"]) == 3 * 4 * (STEPS + 1), case
            torch.testing.assert_close(r["set_weight"], r["new_w"], rtol=0, atol=0)
            assert r["local_roundtrip"], case
            assert r["foreign"] is None and r["after_destroy"] is None, case


def _bad_state_keys(rank: int, world: int) -> list[str]:
    import ds_strategy.runtime as rt
    from ds_strategy.utils import safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    engine, *_ = rt.initialize(model=model, config=cfg)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    errors = []
    for key in ("step", "nope"):  # the 1-element bias: only one rank holds a piece of it
        try:
            safe_get_full_optimizer_state(model[2].bias, key)
        except (ValueError, KeyError) as err:
            errors.append(type(err).__name__)
    engine.destroy()
    return errors


def test_a_bad_state_key_raises_on_every_rank_not_only_where_the_piece_is() -> None:
    assert run_distributed(_bad_state_keys, world_size=2, timeout=60) == [["ValueError", "KeyError"]] * 2
