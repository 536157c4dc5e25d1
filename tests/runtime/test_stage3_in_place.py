"""Stage 3 at world size 1 gathers in place ([Note: a group of one gathers in place] in sharded.py): a
bucket's gathered tensor is its partition, so a fetch allocates and copies nothing, the gathered bytes
stay zero, and training is bitwise what gathering into separate bucket tensors gives (``GATHER_IN_PLACE``
off: the path every rank of a larger group takes), in fp32 (the partition is the fp32 master) and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import config, make_tied, token_batches


def _train(rank: int, precision: str, in_place: bool) -> dict:
    import ds_strategy.runtime as rt
    from ds_strategy.runtime.zero.sharded import ShardedGroup
    from ds_strategy.zero import GatheredParameters

    ShardedGroup.GATHER_IN_PLACE = in_place
    try:
        cfg = config(stage=3, precision=precision, micro=2, gas=2, bucket=100)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 40  # the LayerNorm stays whole
        model = make_tied(seed=0)
        engine, *_ = rt.initialize(model=model, config=cfg)
    finally:
        ShardedGroup.GATHER_IN_PLACE = True
    storages = engine.stage.storages
    seen: dict[str, object] = {"gathered": [], "inside": True}

    def during_forward(module: torch.nn.Module, args: object, output: object) -> None:
        seen["gathered"].append(engine.memory_breakdown()["gathered_params"])  # type: ignore[union-attr]
        for gs in storages:  # a live in-place bucket's parameters point into the partition's storage
            part = gs.part.untyped_storage().data_ptr()
            for b in gs.in_place:
                if gs.live[b]:
                    inside = all(gs.params[i].untyped_storage().data_ptr() == part for i in gs.layout.buckets[b].params)
                    seen["inside"] = seen["inside"] and inside

    hooks = [m.register_forward_hook(during_forward) for m in model.modules() if list(m.parameters(recurse=False))]
    losses = []
    for x, y in token_batches(3, 2 * 2):
        for i in range(2):
            loss = engine(x[i * 2 : i * 2 + 2], y[i * 2 : i * 2 + 2])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    for h in hooks:
        h.remove()
    params = list(model.parameters())
    with GatheredParameters(params):
        weights = [p.detach().clone() for p in params]
    weights += [m.detach().clone() for gs in storages for m in gs.masters]
    out = {
        "in_place": sum(len(gs.in_place) for gs in storages),
        "buckets": sum(len(gs.layout.buckets) - len(gs.persistent) for gs in storages),
        "gathered": seen["gathered"],
        "inside": seen["inside"],
        "losses": losses,
        "weights": weights,
    }
    engine.destroy()
    return out


def _compare(rank: int, world: int, precision: str) -> list[str]:
    fast, plain = _train(rank, precision, True), _train(rank, precision, False)
    errors = []
    if not (fast["in_place"] == fast["buckets"] > 0 and plain["in_place"] == 0):
        errors.append(f"in-place buckets {fast['in_place']} of {fast['buckets']}; off: {plain['in_place']}")
    if any(fast["gathered"]) or not any(plain["gathered"]):
        errors.append(f"gathered bytes in place {set(fast['gathered'])}, off {set(plain['gathered'])}")
    if not fast["inside"]:
        errors.append("a live in-place bucket's parameter does not point into the partition")
    if fast["losses"] != plain["losses"]:
        errors.append(f"losses {fast['losses']} != {plain['losses']}")
    errors += [
        f"tensor {i} differs"
        for i, (a, b) in enumerate(zip(fast["weights"], plain["weights"], strict=True))
        if not torch.equal(a, b)
    ]
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_world_size_one_gathers_in_place_and_trains_bitwise_alike(precision: str) -> None:
    (errors,) = run_distributed(_compare, world_size=1, args=(precision,), timeout=240)
    assert errors == []
