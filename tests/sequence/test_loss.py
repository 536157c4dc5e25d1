"""``sequence_loss`` against ``F.cross_entropy`` over the whole sequence in one process, tiled and untiled.

Every rank builds the same full logits (or hidden states and head) and uses its slice of the sequence; the
gradients of the replicated tensors are averaged over all ranks as the engine does. The ignored targets are
spread unevenly: most of the first shard is ignored, the others keep every target, so a per-shard mean
would be wrong. Tolerance: fp32, atol 1e-6 / rtol 1e-5 (the same sums in another order). The memory test
tracks the bytes of every live tensor storage made during forward + backward (a dispatch mode) and expects
the tiled loss to peak at under half the untiled one.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ds_strategy.sequence import sequence_loss
from tests.harness import run_distributed
from tests.sequence.common import layout, shard

TOL = {"atol": 1e-6, "rtol": 1e-5}


def _targets(b: int, s: int, v: int) -> torch.Tensor:
    labels = torch.randint(0, v, (b, s))
    labels[:, : s // 4] = -100  # the first shard mostly ignored (the first half of it at sp 2)
    labels[1, -1] = -100
    return labels


def _logits_body(rank: int, world: int, sp: int) -> None:
    torch.manual_seed(0)
    b, s, v = 2, 6 * sp, 11
    full = torch.randn(b, s, v, requires_grad=True)
    labels = _targets(b, s, v)
    ref = F.cross_entropy(full.reshape(-1, v), labels.reshape(-1), ignore_index=-100)
    (ref_grad,) = torch.autograd.grad(ref, full)
    with layout(sp) as groups:
        for chunk in (None, 4):  # 4 does not divide the 6 positions per rank: a short last tile
            loss = sequence_loss(shard(full, groups, 1), shard(labels, groups, 1), chunk_size=chunk)
            torch.testing.assert_close(loss, ref.detach(), **TOL)  # the same value on every rank
            (grad,) = torch.autograd.grad(loss, full)
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / world, ref_grad, **TOL)


@pytest.mark.parametrize(("world", "sp"), [(2, 2), (4, 4), (4, 2)])
def test_logits_match_one_process(world: int, sp: int) -> None:
    run_distributed(_logits_body, world_size=world, args=(sp,))


def _head_body(rank: int, world: int) -> None:
    torch.manual_seed(0)
    b, s, h, v = 2, 10 * world, 8, 13
    head = nn.Linear(h, v)
    hidden = torch.randn(b, s, h, requires_grad=True)
    labels = _targets(b, s, v)
    ref = F.cross_entropy(head(hidden).reshape(-1, v), labels.reshape(-1))
    ref_grads = torch.autograd.grad(ref, [hidden, *head.parameters()])
    with layout(world) as groups:
        for chunk in (None, 3, 10, 64):
            loss = sequence_loss(shard(hidden, groups, 1), shard(labels, groups, 1), head=head, chunk_size=chunk)
            torch.testing.assert_close(loss, ref.detach(), **TOL)
            grads = torch.autograd.grad(loss, [hidden, *head.parameters()])
            for got, want in zip(grads, ref_grads, strict=True):
                got = got.clone()
                dist.all_reduce(got)
                torch.testing.assert_close(got / world, want, **TOL)


def test_tiled_head_matches_one_process() -> None:
    run_distributed(_head_body, world_size=2)


def test_no_layout_is_the_plain_token_mean() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 7), _targets(3, 5, 7)
    want = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))
    torch.testing.assert_close(sequence_loss(logits, labels), want, **TOL)
    assert sequence_loss(logits, torch.full((3, 5), -100)).item() == 0.0  # nothing to learn: 0, not nan
    with pytest.raises(ValueError, match=r"labels have shape \(3, 4\).*\(3, 5\)"):
        sequence_loss(logits, labels[:, :4])
    with pytest.raises(ValueError, match="chunk_size=0"):
        sequence_loss(logits, labels, chunk_size=0)


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes held by the tensor storages created while active (views counted once)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, key)  # holds no reference to the storage
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _peak(chunk: int | None) -> tuple[int, float]:
    torch.manual_seed(0)
    b, s, h, v = 2, 256, 16, 1000
    head = nn.Linear(h, v, bias=False)
    hidden = torch.randn(b, s, h, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    with PeakBytes() as mode:
        loss = sequence_loss(hidden, labels, head=head, chunk_size=chunk)
        loss.backward()
    return mode.peak, loss.item()


def test_tiling_lowers_the_peak() -> None:
    full, full_loss = _peak(None)
    tiled, tiled_loss = _peak(32)
    logits_bytes = 2 * 256 * 1000 * 4
    assert full >= 2 * logits_bytes, full  # the logits and their log-softmax at least
    assert tiled < full / 2, (tiled, full)
    assert tiled_loss == pytest.approx(full_loss, rel=1e-6)
