"""Stage 3 with default keys holds at most a block and the one prefetched ([Note: reshard after use] in
prefetch.py, [Note: prefetch after release] in module_hooks.py): the planner's rules on a recorded order, and
an adapter fine-tune (frozen blocks, small trained adapters) on 2 ranks, where a frozen block's buckets are
freed by a hook that used to run after the next block's prefetch."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Container, Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

WORLD, LAYERS, WIDTH, STEPS = 2, 4, 48, 3


class _Buckets:
    """The planner's view of the gathered buckets: one bucket per unit, none gathered."""

    def __init__(self, sizes: Mapping[tuple[int, int], int]) -> None:
        self.sizes = dict(sizes)
        self.gathered: set[tuple[int, int]] = set()

    @property
    def groups(self) -> Sequence[Any]:
        return []

    @property
    def inflight(self) -> Container[tuple[int, int]]:
        return set()

    @property
    def users(self) -> Mapping[tuple[int, int], int]:
        return {}

    def live(self, key: tuple[int, int]) -> bool:
        return key in self.gathered

    def numel(self, key: tuple[int, int]) -> int:
        return self.sizes[key]

    def live_numel(self) -> int:
        return sum(self.sizes[k] for k in self.gathered)

    def free(self, key: tuple[int, int]) -> None:
        self.gathered.discard(key)


def _planner_at(trace: list[int], position: int) -> Any:
    """A planner following ``trace`` (module ids 1..n, unit (0, id) each), its cursor past ``position``."""
    from ds_strategy.runtime.zero.prefetch import PrefetchPlanner

    units = {mid: [(0, mid)] for mid in set(trace)}
    planner = PrefetchPlanner(
        units, _Buckets({(0, m): 10 for m in units}), prefetch_numel=None, max_live_numel=10**9, reuse_distance=None
    )
    planner.begin()
    for mid in trace:
        planner.advance(mid)
    planner.finish()
    planner.begin()
    for mid in trace[: position + 1]:
        planner.advance(mid)
    return planner


def test_the_last_block_prefetches_nothing_and_only_it_stays_for_its_backward() -> None:
    trace = [1, 2, 3, 4, 4, 3, 2, 1]  # four blocks: forward, then backward
    # A block in forward prefetches the next one.
    assert _planner_at(trace, 1).plan({(0, 2)}, 0) == [(0, 3)]
    # The last block of the forward: its own backward comes next, so nothing is gathered across the head and
    # the loss (block 3 would wait there gathered for two fetches).
    assert _planner_at(trace, 3).plan({(0, 4)}, 0) == []
    # Its backward prefetches the block before it.
    assert _planner_at(trace, 4).plan({(0, 4)}, 0) == [(0, 3)]
    # Kept after use: only a unit one of the next two fetches reads again. Block 4 is (its backward is the
    # next fetch); block 3 is not (two fetches of block 4 come first), block 1 neither.
    assert _planner_at(trace, 3).reused_soon((0, 4))
    assert not _planner_at(trace, 2).reused_soon((0, 3))
    assert not _planner_at(trace, 0).reused_soon((0, 1))
    # A unit fetched twice in a row (a module called twice) stays between the calls.
    assert _planner_at([1, 1, 2, 2, 1], 0).reused_soon((0, 1))


def test_the_forward_ends_where_the_next_fetch_repeats_the_last_one() -> None:
    """``at_forward_end`` ([Note: the loss's peak] in runtime/host_memory.py): after the last block's forward
    (its backward is the next fetch), not inside the forward or the backward, and not before a record."""
    trace = [1, 2, 3, 4, 4, 3, 2, 1]
    assert [_planner_at(trace, at).at_forward_end() for at in range(len(trace))] == [
        False, False, False, True, False, False, False, False,
    ]  # fmt: skip
    from ds_strategy.runtime.zero.prefetch import PrefetchPlanner

    recording = PrefetchPlanner(
        {1: [(0, 1)]}, _Buckets({(0, 1): 10}), prefetch_numel=None, max_live_numel=10**9, reuse_distance=None
    )
    recording.begin()
    recording.advance(1)
    assert not recording.at_forward_end()


class _Block(nn.Module):
    """A frozen MLP block with a trained low-rank adapter beside it, as peft's LoRA puts one."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.lora_a = nn.Linear(WIDTH, 2, bias=False)
        self.lora_b = nn.Linear(2, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) + self.lora_b(self.lora_a(x))


class _Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _adapter_run(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    torch.manual_seed(0)
    model = _Adapted()
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=cfg)
    gatherer = engine.stage.gatherer
    at_head: list[int] = []
    held = weakref.ref(gatherer)  # the hook must not keep the gatherer alive past destroy (checked below)
    model.head.register_forward_pre_hook(lambda *_: at_head.append(held().live_numel()))  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(rank)
    losses, peaks = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        gatherer.peak_live = 0
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        peaks.append(gatherer.peak_live)
    block = sum(gatherer.numel(k) for k in gatherer.units[id(model.blocks[1])])
    rest = sum(gatherer.numel(k) for k in gatherer.units[id(model)])  # the embedding and the head
    partition = weakref.ref(gatherer.groups[0].rest)
    # The caller keeps the last loss (its graph backpropagated) and one more, never backpropagated.
    kept = [loss, engine(torch.randint(0, 64, (2, 8), generator=gen))]
    engine.destroy()
    del engine, gatherer
    gc.collect()
    freed = partition() is None  # [Note: the graph holds the hooks weakly]
    del kept
    return {"losses": losses, "peaks": peaks, "at_head": at_head, "block": block, "rest": rest, "freed": freed}


@pytest.mark.multiprocess
def test_an_adapter_fine_tune_holds_a_block_and_its_prefetch_at_most() -> None:
    for r in run_distributed(_adapter_run, world_size=WORLD, timeout=120):
        block, rest = r["block"], r["rest"]
        assert rest and block > rest / 2, r  # the unit sizes this test is about
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        # Once the order is recorded (step 2 on): the root's unit (gathered for the whole forward, and, frozen
        # with inputs that take no gradient, for the whole backward), the block in use and the next one, also
        # in backward, where the frozen block whose backward ended used to be freed only after the next
        # block's prefetch was issued (three blocks).
        assert max(r["peaks"][1:]) == rest + 2 * block, r
        # At the head (step 2 on): the root's unit alone. The recorded order is root, embed, blocks 0-3, head,
        # then root, head (the root's unit again) and blocks 3-0: block 3's backward is four fetches after its
        # forward, so it is freed like the others (FSDP2's reshard after forward) and prefetched when the
        # head's backward starts; where the last block's backward is the very next fetch (a tiled head, the
        # planner test above) it stays.
        assert r["at_head"][1:STEPS] == [rest] * (STEPS - 1), r
        # Graphs kept past the engine (a loss held by the caller) do not keep its partitions alive.
        assert r["freed"], r
