"""PipelineModule pieces without training: topologies, partition methods and the 1F1B schedule, each
checked against DeepSpeed's own functions where DeepSpeed is installed (same placement of layers)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from ds_strategy.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
    bubble_fraction,
    train_schedule,
)
from ds_strategy.runtime.pipe.module import partition_layers
from ds_strategy.runtime.pipe.partition import partition_balanced, partition_uniform
from tests.harness import run_distributed
from tests.runtime.pipe_common import specs


def test_topology_axes_and_groups() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.world_size() == 6
    assert topo.get_rank(pipe=1, data=2) == 5
    assert topo.get_coord(4) == topo.ProcessCoord(pipe=1, data=1)
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]
    assert topo.filter_match(pipe=0) == [0, 1, 2]
    assert topo.get_dim("model") == 0
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert three.get_axis_names() == ["pipe", "data", "model"]
    assert three.get_rank_repr(3) == "model_01"
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(pipe=0)


def test_topology_matches_deepspeed() -> None:
    ds = pytest.importorskip("deepspeed.runtime.pipe.topology")
    for ours, theirs in [
        (PipeDataParallelTopology(2, 2), ds.PipeDataParallelTopology(2, 2)),
        (PipeModelDataParallelTopology(2, 2, 3), ds.PipeModelDataParallelTopology(2, 2, 3)),
        (ProcessTopology(["a", "b", "c"], [2, 3, 2]), ds.ProcessTopology(["a", "b", "c"], [2, 3, 2])),
    ]:
        assert ours.world_size() == theirs.world_size()
        for rank in range(ours.world_size()):
            assert tuple(ours.get_coord(rank)) == tuple(theirs.get_coord(rank))
        for axis in ours.get_axis_names():
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)


def test_partitions_match_deepspeed() -> None:
    utils = pytest.importorskip("deepspeed.runtime.utils")
    rng = random.Random(0)
    for _ in range(200):
        n, parts = rng.randint(1, 14), rng.randint(1, 5)
        weights = [rng.choice([0, 1, 2, 5, 100, rng.randint(0, 1000)]) for _ in range(n)]
        assert partition_uniform(n, parts) == list(utils.partition_uniform(n, parts)), (n, parts)
        assert partition_balanced(weights, parts) == [int(x) for x in utils.partition_balanced(weights, parts)], weights


def test_partition_methods() -> None:
    layers = specs()  # 7 layers: tied 64, linear 144, tanh, linear 136, tanh, tied 64, linear 36
    assert partition_layers(layers, 2, "uniform") == [0, 4, 7]
    assert partition_layers(layers, 2, "parameters") == partition_balanced([64, 144, 0, 136, 0, 64, 36], 2)
    assert partition_layers(layers, 2, "type:linear") == partition_balanced([1, 1, 0, 1, 0, 1, 1], 2)
    assert partition_layers(layers, 3, "type:^tanh$") == partition_balanced([0, 0, 1, 0, 1, 0, 0], 3)
    with pytest.raises(ValueError, match="matches no layer; the layer class names are"):
        partition_layers(layers, 2, "type:Conv")
    with pytest.raises(ValueError, match="valid: 'parameters', 'uniform', 'type:<regex>'"):
        partition_layers(layers, 2, "profile")


def test_parameters_partition_counts_on_meta() -> None:
    built: list[torch.device] = []

    class Probe(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            built.append(self.weight.device)

    partition_layers([LayerSpec(Probe), LayerSpec(Probe)], 2, "parameters")
    assert built == [torch.device("meta")] * 2


@pytest.mark.parametrize(("m", "p"), [(1, 2), (4, 2), (8, 4), (3, 4)])
def test_1f1b_schedule(m: int, p: int) -> None:
    for s in range(p):
        steps = train_schedule(m, p, s)
        assert [i for k, i in steps if k == "forward"] == list(range(m))
        assert [i for k, i in steps if k == "backward"] == list(range(m))
        live = peak = 0
        for kind, _ in steps:
            live += 1 if kind == "forward" else -1
            peak = max(peak, live)
        assert peak == min(p - s, m)  # 1F1B's memory bound: at most p - s micro-batches in flight
    assert bubble_fraction(4, 2) == pytest.approx(1 / 5)


def _layout(rank: int, world: int) -> dict[str, object]:
    from ds_strategy.pipe import PipelineModule

    seen: list[int] = []

    class Counted(nn.Linear):
        def __init__(self, idx: int) -> None:
            seen.append(idx)
            super().__init__(8, 8)

    layers = [LayerSpec(Counted, i) for i in range(4)] + [TiedLayerSpec("t", nn.Linear, 8, 8)]
    module = PipelineModule(layers, num_stages=2, partition_method="uniform")
    return {"built": seen, "params": sorted(n for n, _ in module.named_parameters()), "ties": sorted(module.tied_comms)}


def test_layers_built_only_on_their_stage() -> None:
    r0, r1 = run_distributed(_layout, world_size=2, timeout=120)
    assert r0["built"] == [0, 1, 2] and r1["built"] == [3]
    assert r0["params"] == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert r1["params"] == ["3.bias", "3.weight", "tied_modules.t.bias", "tied_modules.t.weight"]
    assert r0["ties"] == r1["ties"] == []  # a tie key on one stage needs no group


def _model_axis_warnings(rank: int, world: int, num_mp: int) -> list[str]:
    import warnings

    from ds_strategy.pipe import PipelineModule

    topo = PipeModelDataParallelTopology(num_pp=world // num_mp, num_mp=num_mp, num_dp=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PipelineModule([LayerSpec(nn.Linear, 8, 8) for _ in range(2)], topology=topo, partition_method="uniform")
    return [str(w.message) for w in caught if "no parallelism from ds_strategy" in str(w.message)]


def test_a_model_axis_is_warned_not_silently_ignored() -> None:
    """ds_strategy builds no tensor parallelism: a ``model`` axis above 1 is accepted with a warning naming it."""
    assert run_distributed(_model_axis_warnings, world_size=2, args=(1,), timeout=120) == [[], []]
    for told in run_distributed(_model_axis_warnings, world_size=2, args=(2,), timeout=120):
        assert len(told) == 1 and "{'model': 2}" in told[0]


def _most_in_flight(m: int, p: int) -> list[tuple[int, int]]:
    """Per link (lower stage s): the most activations and the most gradients sent and not yet received,
    over every reachable state of the stages' 1F1B step lists (a stage may take its next step once the
    message it receives has been sent; channels unbounded)."""
    steps = [train_schedule(m, p, s) for s in range(p)]
    fwd = [[sum(1 for k, _ in st[:n] if k == "forward") for n in range(len(st) + 1)] for st in steps]
    bwd = [[sum(1 for k, _ in st[:n] if k == "backward") for n in range(len(st) + 1)] for st in steps]
    best = [(0, 0)] * (p - 1)
    start = (0,) * p
    seen, todo = {start}, [start]
    while todo:
        pos = todo.pop()
        f = [fwd[s][pos[s]] for s in range(p)]
        b = [bwd[s][pos[s]] for s in range(p)]
        best = [(max(a, f[s] - f[s + 1]), max(g, b[s + 1] - b[s])) for s, (a, g) in enumerate(best)]
        for s in range(p):
            if pos[s] == len(steps[s]):
                continue
            kind, i = steps[s][pos[s]]
            if (kind == "forward" and s > 0 and f[s - 1] <= i) or (kind == "backward" and s < p - 1 and b[s + 1] <= i):
                continue
            nxt = (*pos[:s], pos[s] + 1, *pos[s + 1 :])
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return best


@pytest.mark.parametrize("p", [2, 3, 4])
def test_link_depth_bounds_the_messages_in_flight(p: int) -> None:
    """A channel of ``link_depth`` slots per tensor never makes a send wait, in any timing of the stages."""
    from ds_strategy.runtime.pipe.schedule import link_depth

    for m in range(1, 7):
        for s, (acts, grads) in enumerate(_most_in_flight(m, p)):
            assert acts == grads == link_depth(m, p, s), (m, p, s, acts, grads)
