"""ZeRO++ at stage 3 (runtime/zero/zeropp.py, comm/quantized_all_to_all.py): each option against the
unquantized engine and against torch references, on 2 and 4 processes (hpZ and the hierarchical qgZ with a
simulated node size of 2: zero_hpz_partition_size=2 on 4 ranks).

Tolerances: hpZ alone moves exact values, so it matches the plain engine bit for bit. qwZ quantizes what
travels to int8 in blocks of 256 (relative error <= 1/254 of a block's absmax per weight); over 4 steps of
the tiny model the losses stay within 1e-2 (relative) of the unquantized run. qgZ's reduce-scatter is
checked element by element against the error bound its formats give (see _qgz_bound).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_strategy.config import ConfigError
from ds_strategy.runtime.zero.divergence import INDEX_BITS
from tests.harness import run_distributed
from tests.runtime.common import config, make_tied, token_batches

pytestmark = [pytest.mark.multiprocess, pytest.mark.kernels]


def _engine(rank: int, world: int, extra: dict[str, Any], *, logger: bool = True) -> Any:
    import ds_strategy

    model = make_tied()
    cfg = config(stage=3, bucket=300, micro=2, gas=1)
    cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, **extra})
    if logger:
        cfg["comms_logger"] = {"enabled": True}
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine: Any, rank: int, world: int, steps: int = 4) -> list[float]:
    losses = []
    for x, y in token_batches(steps, 2 * world, seed=1):
        loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _bytes(engine: Any) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for row in engine.comms_logger.summary():
        key = (row.op, row.world_size)
        out[key] = out.get(key, 0) + row.total_bytes
    return out


def _run_option(rank: int, world: int, extra: dict[str, Any]) -> tuple[list[float], dict[tuple[str, int], int]]:
    engine = _engine(rank, world, extra)
    losses = _train(engine, rank, world)
    out = _bytes(engine)
    engine.destroy()
    return losses, out


# ---------------------------------------------------------------------- qwZ
def _qwz_gather_is_exact_dequantization(rank: int, world: int) -> None:
    """A quantized bucket gather gives every rank exactly the torch twin's dequantization of every rank's
    int8-quantized shard (blocks of 256), own shard included; GatheredParameters stays exact."""
    from ds_strategy.ops import fallback
    from ds_strategy.runtime.zero.zeropp import WEIGHT_BLOCK

    engine = _engine(rank, world, {"zero_quantized_weights": True}, logger=False)
    gs = engine.stage.storages[0]
    b = next(b for b in range(len(gs.full)) if b not in gs.persistent)
    gs.gather(b, async_op=False, exact=True).wait()
    exact = gs.full[b].clone()
    gs.free(b)
    gs.gather(b, async_op=False).wait()
    rows = exact.view(world, -1)
    q, s = fallback.quantize_blockwise(rows, WEIGHT_BLOCK, 8)
    expected = fallback.dequantize_blockwise_(q, s, WEIGHT_BLOCK, 8, torch.empty_like(rows)).view(-1)
    assert torch.equal(gs.full[b], expected)
    assert not torch.equal(gs.full[b], exact)  # it did quantize
    err = (gs.full[b] - exact).abs().max().item()
    assert err <= exact.abs().max().item() / 254 * 1.0001
    gs.free(b)
    from ds_strategy.zero import GatheredParameters

    params = [gs.params[i] for i in gs.layout.buckets[b].params]
    with GatheredParameters(params):
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]), exact[: sum(p.numel() for p in params)])
    engine.destroy()


def test_qwz_gather_is_exact_dequantization() -> None:
    run_distributed(_qwz_gather_is_exact_dequantization, world_size=2)


@pytest.mark.parametrize("world", [2, 4])
def test_qwz_trains_close_to_unquantized_and_gathers_4x_fewer_bytes(world: int) -> None:
    base = run_distributed(_run_option, world_size=world, args=({},))[0]
    qwz = run_distributed(_run_option, world_size=world, args=({"zero_quantized_weights": True},))[0]
    torch.testing.assert_close(torch.tensor(qwz[0]), torch.tensor(base[0]), rtol=1e-2, atol=0)
    ratio = base[1][("all_gather", world)] / qwz[1][("all_gather", world)]
    assert 3.5 < ratio < 4.0, ratio  # fp32 -> int8 + one fp32 scale per 256 elements (+ padding)


# ---------------------------------------------------------------------- hpZ
def _hpz_backward_stays_in_node(rank: int, world: int) -> tuple[list[float], list[tuple[str, int]]]:
    engine = _engine(rank, world, {"zero_hpz_partition_size": 2})
    seen: list[tuple[str, int]] = []
    phase = ["forward"]
    for gs in engine.stage.storages:
        assert gs.rest.hpz is not None and gs.rest.hpz.world_size == 2
        for coll in (gs.coll, gs.rest.hpz):
            original = coll.all_gather

            def spy(*args: Any, _orig: Any = original, _w: int = coll.world_size, **kwargs: Any) -> Any:
                tag = int(kwargs.get("tag", 0))
                if not (tag and tag & ((1 << INDEX_BITS) - 1) == 0):  # not the divergence check's closing label
                    seen.append((phase[0], _w))
                return _orig(*args, **kwargs)

            coll.all_gather = spy  # type: ignore[method-assign]
    losses = []
    for x, y in token_batches(3, 2 * world, seed=1):
        phase[0] = "forward"
        loss = engine(x[rank::world], y[rank::world])
        phase[0] = "backward"
        engine.backward(loss)
        assert all(gs.rest.secondary for gs in engine.stage.storages)  # kept for the next gathers
        phase[0] = "step"
        engine.step()
        assert not any(gs.rest.secondary for gs in engine.stage.sharded)  # dropped: the parameters changed
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    engine.destroy()
    return losses, seen


def test_hpz_backward_gathers_stay_inside_the_node_group_and_match_exactly() -> None:
    results = run_distributed(_hpz_backward_stays_in_node, world_size=4)
    base = run_distributed(_run_option, world_size=4, args=({},))[0][0]
    for losses, seen in results:
        assert losses == base[:3]  # hpZ moves exact values: bit-identical training
        backward = [w for phase, w in seen if phase == "backward"]
        forward = [w for phase, w in seen if phase == "forward"]
        assert backward and set(backward) == {2}, seen  # every backward re-gather inside the node pair
        assert 4 in forward  # the first gathers of a step read the primary partition over all ranks


def test_hpz_bytes_leave_the_node_only_in_forward() -> None:
    base = run_distributed(_run_option, world_size=4, args=({},))[0]
    hpz = run_distributed(_run_option, world_size=4, args=({"zero_hpz_partition_size": 2},))[0]
    assert hpz[0] == base[0]
    assert hpz[1][("all_gather", 4)] < 0.75 * base[1][("all_gather", 4)]
    assert hpz[1][("all_gather", 2)] > 0


# ---------------------------------------------------------------------- qgZ
def _qgz_bound(inputs: torch.Tensor, node: int, block: int, intra_bits: int, inter_bits: int) -> torch.Tensor:
    """Per-element bound of |quantized reduce-scatter - exact sum| over every chunk (W x W x n inputs: rank,
    chunk, element): each quantization adds at most half its block's scale; step 2's inputs are the node
    partial sums, whose absmax is at most the exact partials' plus step 1's error."""
    world, _, n = inputs.shape
    nodes = world // node

    def half_scale(x: torch.Tensor, bits: int) -> torch.Tensor:  # x: (..., n) -> per element
        qmax = 7 if bits == 4 else 127
        nb = -(-n // block)
        pad = torch.zeros(*x.shape[:-1], nb * block, dtype=torch.float64)
        pad[..., :n] = x.abs()
        return (pad.view(*x.shape[:-1], nb, block).amax(-1) / qmax / 2).repeat_interleave(block, -1)[..., :n]

    x = inputs.double()
    if nodes == 1:
        return half_scale(x, 8).sum(0)
    e1 = half_scale(x, intra_bits)  # rank, chunk, element
    bound = torch.zeros(world, n, dtype=torch.float64)
    for c in range(world):
        local = c % node
        partial_err = [e1[m * node : (m + 1) * node, c].sum(0) for m in range(nodes)]
        partial_abs = [x[m * node : (m + 1) * node, c].sum(0).abs() for m in range(nodes)]
        e2 = sum(half_scale((partial_abs[m] + partial_err[m]).unsqueeze(0), inter_bits)[0] for m in range(nodes))
        bound[c] = sum(partial_err) + e2
        del local
    return bound


def _qgz_reduce_scatter(rank: int, world: int, node: int) -> None:
    from ds_strategy.comm.quantized_all_to_all import TwoStepHandle, quantized_reduce_scatter
    from ds_strategy.runtime.zero.collectives import Collectives
    from ds_strategy.runtime.zero.zeropp import node_groups

    n = 1000  # not a multiple of the block: a short last block
    coll = Collectives()
    intra, inter = node_groups(coll, node)
    gen = torch.Generator().manual_seed(7)
    inputs = torch.randn(world, world, n, generator=gen) * torch.logspace(-2, 1, n)  # every rank's input
    out = torch.empty(n)
    bits = (8, 8) if node == world else (4, 8)
    quantized_reduce_scatter(
        out, inputs[rank].reshape(-1).clone(), intra=intra, inter=inter, block_size=256, intra_bits=bits[0],
        inter_bits=bits[1],
    )  # fmt: skip
    exact = inputs.double().sum(0)[rank]
    bound = _qgz_bound(inputs, node, 256, *bits)[rank]
    err = (out.double() - exact).abs()
    assert (err <= bound * (1 + 1e-4) + 1e-6).all(), float((err - bound).max())
    assert err.max() > 0  # it did quantize

    # Asynchronous: two in flight, their inputs overwritten once issued, waited in reverse order: the blocking
    # results, bit for bit.
    def reduce(output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
        return quantized_reduce_scatter(
            output, input, intra=intra, inter=inter, block_size=256, intra_bits=bits[0], inter_bits=bits[1],
            async_op=async_op,
        )  # fmt: skip

    twice = torch.empty(n)
    reduce(twice, inputs[rank].reshape(-1) * 2, async_op=False)
    sources = [inputs[rank].reshape(-1).clone(), inputs[rank].reshape(-1) * 2]
    outs = [torch.full((n,), float("nan")) for _ in sources]
    handles = [reduce(o, s, async_op=True) for o, s in zip(outs, sources, strict=True)]
    for s in sources:
        s.fill_(float("nan"))
    two_steps = intra.world_size > 1 and inter.world_size > 1
    assert all(isinstance(h, TwoStepHandle) == two_steps for h in handles)  # both steps: asynchronous too
    if two_steps:  # step 2 is issued by advance (or wait), never by polling ([Note: when step 2 is issued])
        assert not any(h.is_completed() for h in handles)
        handles[1].advance()  # out of launch order, as every rank does it
        assert handles[1].advanced and not handles[0].advanced
    for h in reversed(handles):
        assert h is not None
        h.wait()
    assert torch.equal(outs[0], out) and torch.equal(outs[1], twice)
    for c in (intra, inter, coll):
        c.close()


@pytest.mark.parametrize(("world", "node"), [(2, 2), (4, 4), (4, 2), (2, 1)])
def test_qgz_reduce_scatter_within_its_error_bound(world: int, node: int) -> None:
    run_distributed(_qgz_reduce_scatter, world_size=world, args=(node,))


@pytest.mark.parametrize(("world", "extra"), [(2, {}), (4, {"zero_hpz_partition_size": 2})])
def test_qgz_trains_close_to_unquantized_with_fewer_gradient_bytes(world: int, extra: dict[str, Any]) -> None:
    base = run_distributed(_run_option, world_size=world, args=(extra,))[0]
    qgz = run_distributed(_run_option, world_size=world, args=({**extra, "zero_quantized_gradients": True},))[0]
    torch.testing.assert_close(torch.tensor(qgz[0]), torch.tensor(base[0]), rtol=1e-2, atol=0)
    rs = base[1][("reduce_scatter", world)]
    a2a = sum(v for (op, _), v in qgz[1].items() if op == "all_to_all")
    assert ("reduce_scatter", world) not in qgz[1]
    assert rs / a2a > 3.0, (rs, a2a)


class _GPTLoss(torch.nn.Module):
    """A 4-layer GPT (ds_strategy.demo) whose forward is the loss: its buckets complete one by one in backward
    (the tied test net's shared block and embedding complete almost all of its at the end)."""

    def __init__(self) -> None:
        super().__init__()
        from ds_strategy.demo.model import GPT, GPTConfig

        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(vocab_size=24, block_size=8, n_layer=4, n_head=4, n_embd=32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(x, y)


def _qgz_across_nodes(rank: int, world: int, extra: dict[str, Any], hosts_of: int) -> dict[str, Any]:
    """qgZ over 2 (simulated) nodes of 2: the log of what each rank did in order (step 1 / step 2 all-to-alls,
    the end of each backward, each bucket's landing) and the losses. ``hosts_of``: simulate hosts of that many
    ranks (qgZ's node groups otherwise follow the host names: one node here). The ranks run backward at
    different paces (a rank-dependent pause before each block's backward), so each reaches every bucket at
    another time."""
    import ds_strategy

    if hosts_of:
        from ds_strategy.runtime.zero import zeropp

        zeropp._host_node_size = lambda coll: hosts_of  # type: ignore[assignment]
    model = _GPTLoss()
    for i, block in enumerate(model.gpt.blocks):
        pause = 0.005 * ((rank + i) % 4)
        block.register_full_backward_pre_hook(lambda *_, pause=pause: time.sleep(pause))
    cfg = config(stage=3, micro=2, gas=1)
    cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, "zero_quantized_gradients": True})
    cfg["zero_optimization"].update(extra)
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    stage = engine.stage
    intra, inter = stage.zeropp.grad_intra, stage.zeropp.grad_inter
    assert intra.world_size == 2 and inter.world_size == 2
    log: list[Any] = []

    def spy(obj: Any, name: str, event: Any) -> None:
        original = getattr(obj, name)

        def record(*args: Any, **kwargs: Any) -> Any:
            log.append(event(*args) if callable(event) else event)
            return original(*args, **kwargs)

        setattr(obj, name, record)

    spy(stage, "launch_reduction", "launch")
    spy(intra, "all_to_all_single", "step 1")
    spy(inter, "all_to_all_single", "step 2")
    spy(stage, "end_backward", "backward ends")  # loss.backward() has returned
    spy(stage, "land", lambda key, out: ("land", key))
    losses = _train(engine, rank, world)
    buckets = list(stage.bucket_order)
    engine.destroy()
    return {"losses": losses, "log": log, "buckets": buckets}


@pytest.mark.parametrize(
    ("extra", "hosts_of"), [({"zero_hpz_partition_size": 2}, 0), ({}, 2)], ids=["hpz-nodes", "simulated-hosts"]
)
def test_qgz_across_nodes_issues_step_two_during_backward_in_one_order_on_every_rank(
    extra: dict[str, Any], hosts_of: int
) -> None:
    """Issue 47: the second all-to-all overlaps backward (counted in the order of events, not timed): a
    bucket's launch returns with its step 2 pending, which is issued at the next launch, before backward
    ends; every rank issues the collectives in one order and lands the buckets in the recorded order; the
    losses are the blocking reduction's (overlap_comm off) bit for bit."""
    ranks = run_distributed(_qgz_across_nodes, world_size=4, args=(extra, hosts_of))
    blocking = run_distributed(_qgz_across_nodes, world_size=4, args=({**extra, "overlap_comm": False}, hosts_of))
    buckets = ranks[0]["buckets"]
    assert len(buckets) == 5  # 4 blocks, then the embeddings and the last LayerNorm
    for run, overlapped in ((ranks, True), (blocking, False)):
        issued = [[e for e in r["log"] if not isinstance(e, tuple)] for r in run]
        assert all(i == issued[0] for i in issued)  # one order of collectives on every rank
        for r in run:
            landed = [e[1] for e in r["log"] if isinstance(e, tuple)]
            assert landed == buckets * 4  # every step, in the recorded order
            assert r["losses"] == blocking[0]["losses"]
        steps = " ".join(issued[0]).split(" backward ends")  # what each backward issued, then the rest
        n = len(buckets)
        if overlapped:  # step 2 of bucket i at the launch of bucket i + 1, the last one's once backward ended
            backward = "launch step 1" + " launch step 1 step 2" * (n - 1)
            expected = [backward] + [" step 2 " + backward] * 3 + [" step 2"]
        else:  # blocking: both steps inside each launch
            backward = " ".join(["launch step 1 step 2"] * n)
            expected = [backward] + [" " + backward] * 3 + [""]
        assert steps == expected, steps


# ---------------------------------------------------------------------- frozen weights stored quantized
class _LoRA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(64, 64)
        self.base.requires_grad_(False)
        self.a = torch.nn.Linear(64, 4, bias=False)
        self.b = torch.nn.Linear(4, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((self.base(x) + self.b(self.a(x))) ** 2).mean()


def _frozen_quantized(rank: int, world: int, quantized: bool) -> tuple[list[float], int, float]:
    import ds_strategy

    model = _LoRA()
    exact = model.base.weight.detach().clone()
    cfg = config(stage=3, bucket=10_000, micro=2, gas=1)
    cfg["zero_optimization"].update(
        {"stage3_param_persistence_threshold": 0, "zero_quantized_nontrainable_weights": quantized}
    )
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    frozen = engine.stage.frozen[0]
    assert frozen.quantized_rest == quantized
    rest = frozen.numel_bytes()["params"]
    from ds_strategy.zero import GatheredParameters

    with GatheredParameters([model.base.weight]):
        err = (model.base.weight.detach() - exact).abs().max().item()
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        x = torch.randn(2 * world, 64, generator=gen)
        loss = engine(x[rank::world])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses, rest, err / exact.abs().max().item()


def test_frozen_weights_rest_quantized() -> None:
    plain = run_distributed(_frozen_quantized, world_size=2, args=(False,))
    quant = run_distributed(_frozen_quantized, world_size=2, args=(True,))
    for (lp, bp, ep), (lq, bq, eq) in zip(plain, quant, strict=True):
        assert ep == 0.0 and 0 < eq <= 1 / 254 * 1.0001  # int8 blocks: within half a step of the block scale
        assert bq < 0.3 * bp  # fp32 partition -> int8 + scales
        torch.testing.assert_close(torch.tensor(lq), torch.tensor(lp), rtol=1e-2, atol=0)


# ---------------------------------------------------------------------- config
def test_zeropp_keys_need_stage_3() -> None:
    from ds_strategy.config import load_config

    with pytest.raises(ConfigError, match=r"zero_optimization\.zero_quantized_weights"):
        load_config(
            {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}}
        )
    with pytest.raises(ConfigError, match=r"zero_optimization\.zero_hpz_partition_size"):
        load_config(
            {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}}
        )
    cfg = load_config(
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
    )
    assert cfg.zero_optimization.zero_quantized_gradients


def _bad_hpz(rank: int, world: int) -> str:
    try:
        _engine(rank, world, {"zero_hpz_partition_size": 3}, logger=False)
    except ConfigError as err:
        return str(err)
    return ""


def test_hpz_size_must_divide_the_world() -> None:
    for message in run_distributed(_bad_hpz, world_size=2):
        assert "zero_optimization.zero_hpz_partition_size" in message and "must divide" in message


def _frozen_checkpoint_round_trip(rank: int, world: int, path: str) -> None:
    """Saved int8 frozen partitions load back into a fresh engine (same values); a plain engine loads them
    too (dequantized)."""
    import ds_strategy
    from ds_strategy.zero import GatheredParameters

    def build(quantized: bool, seed: int) -> Any:
        model = _LoRA()
        with torch.no_grad():
            model.base.weight.mul_(seed)
        cfg = config(stage=3, bucket=10_000, micro=2, gas=1)
        cfg["zero_optimization"].update(
            {"stage3_param_persistence_threshold": 0, "zero_quantized_nontrainable_weights": quantized}
        )
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return engine, model

    def frozen_value(model: Any) -> torch.Tensor:
        with GatheredParameters([model.base.weight]):
            return model.base.weight.detach().clone()

    engine, model = build(True, 1)
    saved = frozen_value(model)
    engine.save_checkpoint(path, tag="t")
    engine.destroy()
    for quantized in (True, False):
        other, other_model = build(quantized, 3)  # different frozen values before the load
        assert not torch.equal(frozen_value(other_model), saved)
        other.load_checkpoint(path, tag="t")
        assert torch.equal(frozen_value(other_model), saved), quantized
        other.destroy()


def test_frozen_quantized_checkpoint_round_trip(tmp_path: Any) -> None:
    run_distributed(_frozen_checkpoint_round_trip, world_size=2, args=(str(tmp_path),))
