"""The gradient hooks' work grows with the model, not with its square: a hook looks at its own bucket only.

Measured on an H200 (2026-11-26): building every bucket's partition view inside each bucket's launch made a
12-layer GPT's stage-3 backward run ~15,000 ``aten::slice`` per step on the CPU, twice the GPU's step time.
Counted here with a dispatch mode over one backward, for a deep and a 4x deeper stack of Linears, every
parameter in a bucket of its own: the op count may grow 4x (linear), not 16x.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.harness import run_distributed


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _ops_in_backward(stage: int, layers: int) -> int:
    import ds_strategy

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 64,  # one weight (64 elements) or bias per bucket at stages 1-2
            "stage3_param_persistence_threshold": 0,  # every Linear gathered and reduced on its own
            "stage3_prefetch_bucket_size": 64,
            "stage3_max_live_parameters": 200,
        },
        "steps_per_print": 10**9,
    }
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, 8)
    for _ in range(2):  # the first step builds what later steps reuse
        loss = engine(x).square().mean()
        with _CountOps() as counter:
            engine.backward(loss)
        engine.step()
    engine.destroy()
    return sum(counter.ops.values())


def _counts(rank: int, world: int) -> dict[int, tuple[int, int]]:
    return {stage: (_ops_in_backward(stage, 16), _ops_in_backward(stage, 64)) for stage in (1, 2, 3)}


@pytest.fixture(scope="module")
def counts() -> dict[int, tuple[int, int]]:
    """Ops in one backward per stage, (16 layers, 64 layers), from one run on 2 ranks."""
    return run_distributed(_counts, world_size=2)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_backward_work_grows_linearly_with_the_bucket_count(stage: int, counts: dict[int, tuple[int, int]]) -> None:
    # Before the fix: 1480 -> 18184 ops at stage 1 (12x); after: 488 -> 1928 (3.95x).
    small, large = counts[stage]
    assert large <= 4.6 * small, f"stage {stage}: {small} ops for 16 layers, {large} for 64 (4x would be linear)"
