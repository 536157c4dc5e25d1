"""The collectives module: gloo's all_reduce-based reduce_scatter/all_gather equal the native ones."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.multiprocess


def _compare(rank: int, world: int) -> list[str]:
    from ds_strategy.runtime.zero.collectives import Collectives

    native = Collectives(fast_path=False, emulate_gloo=False)
    emulated = Collectives(fast_path=False, emulate_gloo=True)
    assert emulated.emulate_gloo and Collectives(fast_path=False).emulate_gloo  # the default on gloo
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(world * 37, generator=g).to(dtype)
        results = []
        for coll in (native, emulated):
            out = torch.empty(37, dtype=dtype)
            coll.reduce_scatter(out, x.clone(), async_op=True).wait()
            inplace = x.clone()  # output = this rank's shard of the input
            coll.reduce_scatter(inplace.view(world, -1)[rank], inplace)
            gathered = torch.full((world * 37,), float("nan"), dtype=dtype)
            coll.all_gather(gathered, x[:37], async_op=True).wait()
            shard_inplace = torch.full((world * 37,), float("nan"), dtype=dtype)
            shard_inplace.view(world, -1)[rank].copy_(x[:37])
            coll.all_gather(shard_inplace, shard_inplace.view(world, -1)[rank])
            summed = x.clone()
            coll.all_reduce(summed)
            results.append((out, inplace.view(world, -1)[rank], gathered, shard_inplace, summed))
        for name, a, b in zip(("rs", "rs_inplace", "ag", "ag_inplace", "ar"), *results, strict=True):
            if not torch.equal(a, b):
                problems.append(f"{dtype} {name}")
        expected_rs = results[0][4].view(world, -1)[rank]
        if not torch.equal(results[0][0], expected_rs):
            problems.append(f"{dtype} reduce_scatter is not the shard of the sum")
    return problems


def test_emulated_and_native_collectives_agree() -> None:
    assert run_distributed(_compare, world_size=2) == [[], []]
