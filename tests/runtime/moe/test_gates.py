"""The gates and the MoE layer against hand-written per-token loop references (single process).

References walk tokens one by one in plain Python (no einsum, no cumsum), so they restate DeepSpeed's
routing rules independently. The same random draws are replayed by reseeding. Tolerance: fp32,
rtol 1e-6 / atol 1e-6 on values computed in a different order; exact on masks and counts.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.moe import MoE, TopKGate, split_params_into_different_moe_groups_for_optimizer, top1gating, top2gating
from ds_strategy.runtime.moe.gates import capacity_of, gumbel_rsample, multiplicative_jitter
from tests.runtime.moe.common import MoENet

TOL = {"rtol": 1e-6, "atol": 1e-6}


def ref_top1(logits, capacity, priority=None, choice=None, used=None):
    """(combine [S,E,C], counts, l_aux) for top-1; priority [S,E] (RTS) or token order."""
    s_n, e_n = logits.shape
    logits = logits.detach()
    gates = torch.softmax(logits, dim=1)
    pick = [int(torch.argmax(gates[s] if choice is None else choice[s])) for s in range(s_n)]
    routed = [s for s in range(s_n) if used is None or used[s] > 0]
    counts = [sum(1 for s in routed if pick[s] == e) for e in range(e_n)]
    keep = set()
    for e in range(e_n):
        mine = [s for s in routed if pick[s] == e]
        if priority is not None:
            mine = sorted(mine, key=lambda s: -float(priority[s, e]))
        keep |= set(mine[:capacity])
    combine = torch.zeros(s_n, e_n, capacity)
    slot = [0] * e_n
    for s in range(s_n):  # slots in token order among the kept
        if s in keep:
            e = pick[s]
            combine[s, e, slot[e]] = gates[s, e]
            slot[e] += 1
    me = gates.mean(0)
    ce = torch.tensor([sum(1 for s in routed if pick[s] == e) / s_n for e in range(e_n)])
    return combine, counts, float(sum(me[e] * ce[e] for e in range(e_n)).detach() * e_n)


def ref_top2(logits, capacity, second_choice):
    s_n, e_n = logits.shape
    logits = logits.detach()
    gates = torch.softmax(logits, dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(s_n)]
    second = []
    for s in range(s_n):
        row = second_choice[s].clone()
        row[first[s]] = -math.inf
        second.append(int(torch.argmax(row)))
    counts = [first.count(e) + second.count(e) for e in range(e_n)]
    loc1 = {}
    used = [0] * e_n
    for s in range(s_n):
        loc1[s] = used[first[s]]
        used[first[s]] += 1
    loc2 = {}
    for s in range(s_n):  # second choices queue behind every first choice of that expert
        loc2[s] = used[second[s]]
        used[second[s]] += 1
    combine = torch.zeros(s_n, e_n, capacity)
    for s in range(s_n):
        k1, k2 = loc1[s] < capacity, loc2[s] < capacity
        g1 = float(gates[s, first[s]]) if k1 else 0.0
        g2 = float(gates[s, second[s]]) if k2 else 0.0
        denom = max(g1 + g2, torch.finfo(torch.float32).eps)
        if k1:
            combine[s, first[s], loc1[s]] = g1 / denom
        if k2:
            combine[s, second[s], loc2[s]] = g2 / denom
    me = gates.mean(0)
    ce = torch.tensor([first.count(e) / s_n for e in range(e_n)])
    return combine, counts, float(sum(me[e] * ce[e] for e in range(e_n)) / e_n * e_n * e_n)


def test_capacity() -> None:
    assert capacity_of(10, 4, 1.0, 1) == 3  # ceil(2.5)
    assert capacity_of(10, 4, 1.0, 4) == 4  # min_capacity
    assert capacity_of(16, 4, 1.25, 1) == 5


@pytest.mark.parametrize("use_rts", [False, True])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 8.0])
def test_top1_matches_loop_reference(use_rts: bool, capacity_factor: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(24, 4) * 2
    logits[:, 1] += 1.5  # expert 1 is popular: tokens drop at small capacity
    cap = capacity_of(24, 4, capacity_factor, 1)
    torch.manual_seed(7)
    l_aux, combine, dispatch, counts = top1gating(logits, capacity_factor, 1, use_rts=use_rts)
    torch.manual_seed(7)
    prio = torch.rand(24, 4) if use_rts else None
    ref, ref_counts, ref_aux = ref_top1(logits, cap, priority=prio)
    assert combine.shape == (24, 4, cap)
    torch.testing.assert_close(combine, ref, **TOL)
    assert torch.equal(dispatch, ref.bool())
    assert counts.tolist() == ref_counts and counts.device.type == "cpu"
    assert l_aux.item() == pytest.approx(ref_aux, rel=1e-6)
    if capacity_factor == 0.5:
        assert int(dispatch.sum()) < 24  # something dropped: the drop path is exercised


def test_top1_rts_keeps_a_random_subset() -> None:
    logits = torch.zeros(32, 2)
    logits[:, 0] = 1.0  # everyone wants expert 0; capacity 4
    kept = set()
    for seed in range(5):
        torch.manual_seed(seed)
        _, _, dispatch, _ = top1gating(logits, 0.25, 1, use_rts=True)
        kept.add(tuple(dispatch[:, 0].any(1).nonzero().flatten().tolist()))
    assert len(kept) > 1  # different tokens survive with different draws
    _, _, dispatch, _ = top1gating(logits, 0.25, 1, use_rts=False)
    assert dispatch[:, 0].any(1).nonzero().flatten().tolist() == [0, 1, 2, 3]  # without RTS: the first ones


def test_top1_rsample_and_used_token() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 4)
    used = torch.ones(16)
    used[3] = used[9] = 0
    torch.manual_seed(3)
    l_aux, combine, _, counts = top1gating(logits, 4.0, 1, used_token=used, noisy_gate_policy="RSample", use_rts=False)
    torch.manual_seed(3)
    noisy = logits + gumbel_rsample(logits.shape, logits.device)
    ref, ref_counts, ref_aux = ref_top1(logits, combine.shape[2], choice=noisy, used=used)
    torch.testing.assert_close(combine, ref, **TOL)
    assert counts.tolist() == ref_counts and sum(ref_counts) == 14
    assert l_aux.item() == pytest.approx(ref_aux, rel=1e-6)


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("capacity_factor", [0.5, 4.0])
def test_top2_matches_loop_reference(sampling: bool, capacity_factor: float) -> None:
    torch.manual_seed(2)
    logits = torch.randn(20, 5) * 2
    cap = capacity_of(20, 5, capacity_factor * 2, 1)
    torch.manual_seed(11)
    l_aux, combine, dispatch, counts = top2gating(logits, capacity_factor, 1, top2_2nd_expert_sampling=sampling)
    torch.manual_seed(11)
    second = logits + gumbel_rsample(logits.shape, logits.device) if sampling else logits
    ref, ref_counts, ref_aux = ref_top2(logits, cap, second)
    torch.testing.assert_close(combine, ref, **TOL)
    assert torch.equal(dispatch, ref.bool())
    assert counts.tolist() == ref_counts and sum(ref_counts) == 40
    assert l_aux.item() == pytest.approx(ref_aux, rel=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_no_drop_capacity_is_the_largest_count(k: int) -> None:
    torch.manual_seed(4)
    logits = torch.randn(30, 3)
    logits[:, 0] += 3
    gate = top1gating if k == 1 else top2gating
    _, combine, dispatch, counts = (
        gate(logits, 0.1, 1, drop_tokens=False)
        if k == 1
        else gate(logits, 0.1, 1, drop_tokens=False, top2_2nd_expert_sampling=False)
    )
    assert combine.shape[2] == int(counts.max())
    assert int(dispatch.sum()) == 30 * k  # nothing dropped
    torch.testing.assert_close(combine.sum((1, 2)), torch.ones(30) if k == 2 else torch.softmax(logits, 1).max(1)[0])


def test_gate_jitter_training_only_and_eval_capacity() -> None:
    torch.manual_seed(5)
    gate = TopKGate(
        6,
        3,
        k=1,
        capacity_factor=0.5,
        eval_capacity_factor=3.0,
        min_capacity=1,
        noisy_gate_policy="Jitter",
        use_rts=False,
    )
    x = torch.randn(12, 6)
    torch.manual_seed(9)
    _, combine, _, _ = gate(x)
    torch.manual_seed(9)
    logits = F.linear(multiplicative_jitter(x.float()), gate.wg.weight)
    ref, _, _ = ref_top1(logits, capacity_of(12, 3, 0.5, 1))
    torch.testing.assert_close(combine, ref, **TOL)
    gate.eval()
    _, combine, _, _ = gate(x)
    assert combine.shape[2] == capacity_of(12, 3, 3.0, 1)
    ref, _, _ = ref_top1(F.linear(x, gate.wg.weight), combine.shape[2])
    torch.testing.assert_close(combine, ref, **TOL)  # no noise in eval


def test_gate_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="k=3"):
        TopKGate(4, 2, k=3)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(4, 2, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="num_experts=3 must be a positive multiple of ep_size=2"):
        MoE(4, nn.Linear(4, 4), num_experts=3, ep_size=2)


def _expert(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("use_residual", [False, True])
def test_moe_layer_matches_token_loop(k: int, use_residual: bool) -> None:
    torch.manual_seed(6)
    d = 8
    moe = MoE(
        d,
        _expert(d),
        num_experts=4,
        k=k,
        capacity_factor=0.75,
        min_capacity=1,
        use_residual=use_residual,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    x = torch.randn(3, 7, d)
    out, l_aux, counts = moe(x)
    tokens = x.reshape(-1, d)
    logits = F.linear(tokens, moe.deepspeed_moe.gate.wg.weight)
    s_n = tokens.shape[0]
    if k == 1:
        combine, ref_counts, ref_aux = ref_top1(logits, capacity_of(s_n, 4, 0.75, 1))
    else:
        combine, ref_counts, ref_aux = ref_top2(logits, capacity_of(s_n, 4, 1.5, 1), logits)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    ref = torch.zeros_like(tokens)
    for s in range(s_n):
        for e in range(4):
            w = combine[s, e].sum()
            if w != 0:
                ref[s] += w * experts[e](tokens[s : s + 1])[0]
    if use_residual:
        coef = torch.softmax(moe.coefficient(tokens), -1)
        ref = ref * coef[:, :1] + moe.mlp(tokens) * coef[:, 1:]
    torch.testing.assert_close(out.reshape(-1, d), ref, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == ref_counts
    assert l_aux.item() == pytest.approx(ref_aux, rel=1e-6)
    (out.sum() + l_aux).backward()
    assert moe.deepspeed_moe.gate.wg.weight.grad is not None  # the gate learns through combine weights and l_aux


def test_expert_params_are_tagged_and_split() -> None:
    moe = MoE(4, nn.Linear(4, 4), num_experts=2, use_residual=True)
    expert_params = list(moe.deepspeed_moe.experts.parameters())
    assert all(p.allreduce is False and p.group_name == "ep_size_1" for p in expert_params)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(moe.parameters()), "lr": 0.1})
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert groups[1]["name"] == "ep_size_1" and groups[1]["lr"] == 0.1
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in expert_params}
    small = split_params_into_different_moe_groups_for_optimizer([{"params": expert_params}], max_group_size=20)
    assert [sum(p.numel() for p in g["params"]) for g in small] == [20, 20]  # weight 16 + bias 4 per expert


def test_whole_model_weights_need_the_expert_groups(tmp_path: Path) -> None:
    """Without its expert-parallel group an ep_size-2 layer cannot say which experts it holds: writing or
    reading the whole model's weights refuses (rather than naming this rank's experts 0 and 1)."""
    from ds_strategy.utils import load_hf_weights, save_hf_weights

    model = MoENet(ep_size=2)
    for action in (lambda: save_hf_weights(model, tmp_path / "out"), lambda: load_hf_weights(model, tmp_path)):
        with pytest.raises(RuntimeError, match="ep_size=2 has no expert-parallel group yet"):
            action()
    single = MoENet(ep_size=1)  # ep_size 1 holds every expert: nothing to know
    save_hf_weights(single, tmp_path / "one")
    load_hf_weights(single, tmp_path / "one")
