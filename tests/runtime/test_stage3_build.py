"""Stage 3's build on 2 ranks: a bucket is partitioned one bounded chunk at a time (``shard_build.BUILD_CHUNK``),
so a block unit's large bucket (the rest of a model: embeddings and head) costs the build 16 MiB of fp32
scratch, not a copy of the bucket.

With a 37-element chunk every bucket spans several chunks, chunk edges fall inside parameters and inside
this rank's shard, and a shard's edge falls inside a chunk. The engine built that way must hold exactly
what an engine built with one chunk per bucket holds (rank 0's values: the ranks build their models from
different seeds), in fp32 and in bf16 (fp32 masters beside the bf16 partition), with persistent and frozen
parameters, from a plain model and from one built under ``zero.Init``; and it must train to the same
losses, bitwise. A wrong offset anywhere changes a value.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import config, make_tied, token_batches

CASES = [("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True)]


def _build_and_train(rank: int, chunk: int, precision: str, init: bool) -> tuple[list[torch.Tensor], list[float]]:
    import ds_strategy.runtime as rt
    from ds_strategy.runtime.zero import shard_build
    from ds_strategy.zero import GatheredParameters, Init

    saved, shard_build.BUILD_CHUNK = shard_build.BUILD_CHUNK, chunk
    try:
        cfg = config(stage=3, precision=precision, micro=2, gas=1, bucket=100)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 40  # the LayerNorm stays whole
        if init:
            with Init(config_dict_or_path=cfg):
                model = make_tied(seed=0)
        else:
            model = make_tied(seed=rank)  # rank 0's values must win
        engine, *_ = rt.initialize(model=model, config=cfg)
    finally:
        shard_build.BUILD_CHUNK = saved
    params = list(model.parameters())
    with GatheredParameters(params):
        weights = [p.detach().clone() for p in params]
    weights += [m.detach().clone() for gs in engine.stage.storages for m in gs.masters]
    losses = []
    for x, y in token_batches(3, 2 * 2):
        loss = engine(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return weights, losses


def _compare(rank: int, world: int, precision: str, init: bool) -> list[str]:
    chunked = _build_and_train(rank, 37, precision, init)
    whole = _build_and_train(rank, 1 << 30, precision, init)
    errors = [
        f"tensor {i} differs"
        for i, (a, b) in enumerate(zip(chunked[0], whole[0], strict=True))
        if not torch.equal(a, b)
    ]
    if chunked[1] != whole[1]:
        errors.append(f"losses {chunked[1]} != {whole[1]}")
    reference = make_tied(seed=0)  # what rank 0 built: every rank must hold its values
    for p, ref in zip(chunked[0], reference.parameters(), strict=False):
        if not torch.equal(p.float(), ref.detach().to(p.dtype).float()):
            errors.append("a parameter is not rank 0's value")
            break
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize(("precision", "init"), CASES)
def test_a_chunked_build_holds_and_trains_exactly_like_a_whole_bucket_build(precision: str, init: bool) -> None:
    for rank, errors in enumerate(run_distributed(_compare, world_size=2, args=(precision, init), timeout=240)):
        assert errors == [], f"rank {rank}: {errors}"
