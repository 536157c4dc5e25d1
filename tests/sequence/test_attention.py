"""``DistributedAttention`` and ``seq_all_to_all`` on 2 and 4 gloo ranks against one process's full attention.

Reference: torch's sdpa (causal) over the whole sequence in one process, fp32; each rank compares its
slice of the output and of the query / key / value gradients (a random output gradient). Tolerances:
fp32 atol 1e-5 (the same arithmetic, other summation orders); bf16 inputs atol 3e-2 / rtol 3e-2 against
the fp32 reference (bf16 has 8 bits of mantissa; values and gradients are O(1)).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_strategy.sequence import DistributedAttention, seq_all_to_all
from tests.harness import run_distributed
from tests.sequence.common import layout, shard

FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 3e-2, "rtol": 3e-2}


def sdpa_sbhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on ``[S, B, H, D]`` (grouped-query when key / value have fewer heads)."""
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.permute(2, 0, 1, 3)


def sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same on ``[B, S, H, D]``."""
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.transpose(1, 2)


def _parity_body(rank: int, world: int, sp: int, dtype_name: str, heads: int, kv_heads: int, how: str) -> float:
    dtype = getattr(torch, dtype_name)
    tol = FP32 if dtype == torch.float32 else BF16
    torch.manual_seed(0)  # the same full tensors on every rank
    s, b, d = 4 * sp, 2, 8
    bshd = how == "bshd"
    seq_dim = 1 if bshd else 0
    shape = (b, s) if bshd else (s, b)
    q, k, v = torch.randn(*shape, heads, d), torch.randn(*shape, kv_heads, d), torch.randn(*shape, kv_heads, d)
    seed = torch.randn(*shape, heads, d)
    local = sdpa_bshd if bshd else sdpa_sbhd
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = local(*ref)
    (ref_out * seed).sum().backward()
    with layout(sp) as groups:
        mine = [shard(t, groups, seq_dim).to(dtype).requires_grad_() for t in (q, k, v)]
        if how == "bshd":  # DeepSpeed's current call: batch_dim_idx=0 right after value
            out = DistributedAttention(local, groups.sp_comm, scatter_idx=2, gather_idx=1)(*mine, 0)
        elif how == "process_group":
            out = DistributedAttention(local, groups.sp_group)(*mine)
        else:  # the active layout
            out = DistributedAttention(local)(*mine)
        assert out.dtype == dtype and out.shape == shard(ref_out, groups, seq_dim).shape
        (out.float() * shard(seed, groups, seq_dim)).sum().backward()
        worst = 0.0
        for got, want in [(out, ref_out)] + [(m.grad, r.grad) for m, r in zip(mine, ref, strict=True)]:
            assert got is not None and want is not None
            want = shard(want.detach(), groups, seq_dim)
            torch.testing.assert_close(got.float(), want, **tol)
            worst = max(worst, float((got.float() - want).abs().max()))
    return worst


CASES = [
    # (world, sp, dtype, heads, kv heads, how)
    (2, 2, "float32", 4, 4, "active"),
    (2, 2, "float32", 4, 2, "process_group"),
    (2, 2, "bfloat16", 4, 4, "active"),
    (4, 4, "float32", 4, 4, "active"),
    (4, 4, "float32", 4, 2, "active"),  # GQA: 2 kv heads replicated twice
    (4, 4, "float32", 4, 1, "bshd"),  # MQA: 1 kv head replicated 4 times; DeepSpeed's batch_dim_idx
    (4, 4, "bfloat16", 8, 2, "active"),
    (4, 2, "float32", 4, 2, "active"),  # sp 2 x dp 2
]


@pytest.mark.parametrize(("world", "sp", "dtype", "heads", "kv", "how"), CASES)
def test_matches_full_attention(world: int, sp: int, dtype: str, heads: int, kv: int, how: str) -> None:
    run_distributed(_parity_body, world_size=world, args=(sp, dtype, heads, kv, how))


def _heads_body(rank: int, world: int) -> str:
    with layout(world):
        x = torch.randn(4, 2, 6, 8)  # 6 heads over 4 ranks
        try:
            DistributedAttention(sdpa_sbhd)(x, x, x)
        except ValueError as err:
            return str(err)
    return "no error"


def test_heads_not_divisible_is_refused() -> None:
    msg = run_distributed(_heads_body, world_size=4)[0]
    assert "6 query heads" in msg and "4 ranks" in msg and "[1, 2, 3, 6]" in msg, msg


def _exchange_body(rank: int, world: int) -> None:
    with layout(world, active=False) as groups:
        torch.manual_seed(1)
        full = torch.randn(3, 4 * world, 2 * world, 5)  # dims: other, sequence, heads, other
        mine = shard(full, groups, 1).clone().requires_grad_()
        # sequence -> heads and back, through both kinds of group, in any dim order
        heads = seq_all_to_all(mine, groups.sp_comm, scatter_idx=2, gather_idx=1)
        torch.testing.assert_close(heads, shard(full, groups, 2), rtol=0, atol=0)
        back = seq_all_to_all(heads, groups.sp_group, scatter_idx=1, gather_idx=-2)
        torch.testing.assert_close(back, mine, rtol=0, atol=0)
        # the backward is the inverse exchange: d(sum(w * heads)) / d(mine) is w's sequence shard
        w = torch.randn(3, 4 * world, 2 * world, 5)
        (heads * shard(w, groups, 2)).sum().backward()
        torch.testing.assert_close(mine.grad, shard(w, groups, 1), rtol=0, atol=0)
        try:
            seq_all_to_all(torch.zeros(3, 3), groups.sp_comm, 0, 1)
        except ValueError as err:
            assert "3 entries" in str(err) and f"group size {world}" in str(err), err
        else:
            raise AssertionError("an indivisible scatter dim was accepted")


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_exchange_and_adjoint(world: int) -> None:
    run_distributed(_exchange_body, world_size=world)


def _many_body(rank: int, world: int) -> None:
    """Query, key and value in one exchange: the same tensors and gradients as three exchanges, in both
    layouts; tensors that differ beyond the scatter dim go one by one."""
    from ds_strategy.sequence import seq_all_to_all_many

    with layout(world, active=False) as groups:
        torch.manual_seed(2 + rank)
        for dims, s, g in (((2, 8 * world, 3, 4), 1, 2), ((3, 2, 8 * world, 4), 2, 0)):  # [B,H,S/P,D], [S/P,B,H,D]
            xs = []
            for heads in (2 * world, world, world):  # query heads, then fewer key / value heads
                shape = list(dims)
                shape[s] = heads
                xs.append(torch.randn(*shape, requires_grad=True))
            one = seq_all_to_all_many(xs, groups.sp_comm, s, g)
            three = [seq_all_to_all(x, groups.sp_comm, s, g) for x in xs]
            weights = [torch.randn_like(t) for t in three]
            for a, b in zip(one, three, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            grads_one = torch.autograd.grad(sum((a * w).sum() for a, w in zip(one, weights, strict=True)), xs)
            grads_three = torch.autograd.grad(sum((b * w).sum() for b, w in zip(three, weights, strict=True)), xs)
            for a, b in zip(grads_one, grads_three, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        odd = [torch.randn(2, world, 3, 4), torch.randn(2, world, 3, 5)]  # another head dim: no packing
        for a, b in zip(
            seq_all_to_all_many(odd, groups.sp_comm, 1, 2),
            [seq_all_to_all(x, groups.sp_comm, 1, 2) for x in odd],
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_several_tensors_in_one_exchange(world: int) -> None:
    run_distributed(_many_body, world_size=world)
