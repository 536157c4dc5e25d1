"""Stage 3's tiled frozen weights ([Note: tiled frozen weights] in runtime/zero/tiled.py): which modules are
tiled, training equal to the single process and to whole gathers, the head and embedding never gathered
whole, the fallback for other reads of the weight, held buckets, the device-strict mode."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import causal_lm_reference

WORLD, STEPS, MICRO, LAYERS, SEQ = 2, 3, 2, 3, 8
TILES = (True, False)
STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}
NO_SHM = {"DS_STRATEGY_SHM": "0"}


def _llama(vocab: int = 1001, tie: bool = False) -> nn.Module:
    """Vocabulary-heavy (a head of 32 x 1001, an odd row count: rows straddle the ranks' shards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32, num_hidden_layers=LAYERS, intermediate_size=64, vocab_size=vocab, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=tie,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():  # an adapter-style fine-tune: the base frozen
        p.requires_grad_(".mlp." in name)
    return model


def _config(precision: str = "fp32", **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40, **zero},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _data(world: int, vocab: int = 1001) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (MICRO * world, SEQ), generator=gen) for _ in range(STEPS)]


def _reference(data: list[torch.Tensor]) -> list[float]:
    return causal_lm_reference(_llama(), data)


def _train(engine: Any, model: nn.Module, data: list[torch.Tensor], rank: int, world: int) -> list[float]:
    dev = engine.device
    losses = []
    for batch in data:
        mine = batch[rank * MICRO : (rank + 1) * MICRO].to(dev)
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


# ---------------------------------------------------------------------- pieces of a flat segment
def test_pieces_cover_any_segment_of_a_weight_exactly() -> None:
    from ds_strategy.runtime.zero.tiled import pieces

    rows, cols = 7, 5
    weight = torch.arange(rows * cols, dtype=torch.float32)
    for first in range(rows * cols):
        for end in range(first + 1, rows * cols + 1):
            rebuilt = torch.full((rows, cols), -1.0)
            for row, col, w in pieces(first, weight[first:end], cols):
                if w.dim() == 2:
                    assert col == 0
                    rebuilt[row : row + w.shape[0]] = w
                else:
                    assert col + w.numel() <= cols
                    rebuilt[row, col : col + w.numel()] = w
            flat = rebuilt.view(-1)
            assert torch.equal(flat[first:end], weight[first:end]), (first, end)
            assert (flat[:first] == -1).all() and (flat[end:] == -1).all(), (first, end)


# ---------------------------------------------------------------------- training, selection, fallbacks
def _tiled_training(rank: int, world: int, precision: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.utils import safe_get_full_fp32_param

    data = _data(world)
    out: dict[str, Any] = {}
    if precision == "fp32":
        out["reference"] = _reference(data)
    for tile in TILES:
        model = _llama()
        params = [p for p in model.parameters() if p.requires_grad]
        cfg = _config(precision, stage3_tile_frozen=tile)
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=cfg)
        gatherer = engine.stage.gatherer
        tiled = {type(tw.module).__name__ for tw in gatherer.unit_map.tiled.values()}
        out[f"tiled_{tile}"] = sorted(tiled)
        out[f"losses_{tile}"] = _train(engine, model, data, rank, world)
        out[f"peak_live_{tile}"] = gatherer.peak_live
        if tile:
            out["head_numel"] = 32 * 1001
            out["mlp"] = {
                n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters() if p.requires_grad
            }
        else:
            out["mlp_whole"] = {
                n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters() if p.requires_grad
            }
        engine.destroy()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_tiled_head_and_embedding_train_like_whole_gathers_and_are_never_gathered_whole(precision: str) -> None:
    for r in run_distributed(_tiled_training, world_size=WORLD, args=(precision,), timeout=300):
        assert r["tiled_True"] == ["Embedding", "Linear"], r["tiled_True"]
        assert r["tiled_False"] == []
        # Against the single process and the whole-gather run: only the summation order of the rows split over
        # two segments differs, which Adam's first steps (lr * g / |g|) amplify for near-zero gradients.
        if precision == "fp32":
            torch.testing.assert_close(
                torch.tensor(r["losses_True"]), torch.tensor(r["reference"]), rtol=2e-5, atol=2e-6
            )
            torch.testing.assert_close(
                torch.tensor(r["losses_True"]), torch.tensor(r["losses_False"]), rtol=1e-6, atol=1e-6
            )
            for name, value in r["mlp"].items():
                torch.testing.assert_close(value, r["mlp_whole"][name], rtol=1e-5, atol=5e-5, msg=name)
        else:  # bf16: a few sign flips of tiny gradients move single elements by 2 * lr; the mean stays put
            torch.testing.assert_close(
                torch.tensor(r["losses_True"]), torch.tensor(r["losses_False"]), rtol=1e-4, atol=1e-4
            )
            for name, value in r["mlp"].items():
                assert (value - r["mlp_whole"][name]).abs().mean() < 1e-3, name
        # never gathered whole: the most gathered at once stays below the head alone
        assert r["peak_live_True"] < r["head_numel"] <= r["peak_live_False"], r


def _selection(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    out = {}
    from ds_strategy.zero import register_external_parameter

    for case in ("tied", "trained head", "small head", "head read elsewhere"):
        model = _llama(vocab=64) if case == "small head" else _llama(tie=case == "tied")
        if case == "trained head":
            model.lm_head.weight.requires_grad_(True)
        if case == "head read elsewhere":  # another module's forward reads the head's weight
            register_external_parameter(model.model.norm, model.lm_head.weight)
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
        out[case] = sorted(type(tw.module).__name__ for tw in engine.stage.gatherer.unit_map.tiled.values())
        engine.destroy()
    return out


@pytest.mark.multiprocess
def test_tied_trained_or_small_weights_are_not_tiled() -> None:
    for r in run_distributed(_selection, world_size=WORLD, timeout=240):
        assert r["tied"] == [], r  # the weight is read by two modules
        assert r["trained head"] == [], r  # a trained rest stays one unit (one reduce-scatter), gathered whole
        assert r["small head"] == [], r  # not over twice the largest unit
        # the head's weight, an external parameter of the norm: not tiled (the norm's unit gathers it whole,
        # which also makes the embedding no larger than twice that unit)
        assert r["head read elsewhere"] == [], r


def test_a_group_of_one_tiles_nothing() -> None:  # its gathered bucket is the partition: nothing to save
    assert run_distributed(_group_of_one, world_size=1, timeout=120) == [[]]


def _group_of_one(rank: int, world: int) -> list[str]:
    import ds_strategy

    model = _llama()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
    tiled = [type(tw.module).__name__ for tw in engine.stage.gatherer.unit_map.tiled.values()]
    engine.destroy()
    return tiled


def _other_reads(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.zero import GatheredParameters

    full = _llama().lm_head.weight.detach().clone()
    model = _llama()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
    assert engine.stage.gatherer.unit_map.tiled
    sums: list[float] = []
    hook = model.lm_head.register_forward_pre_hook(lambda m, a: sums.append(m.weight.sum().item()))
    ids = _data(world)[0][:MICRO]
    with torch.no_grad():
        tiled_logits = engine(input_ids=ids).logits
    hook.remove()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tiled_autocast = engine(input_ids=ids).logits
    with torch.no_grad(), GatheredParameters([model.lm_head.weight, model.model.embed_tokens.weight]):
        held_logits = engine(input_ids=ids).logits  # the gathered bucket is used as it is
        head = model.lm_head.weight.detach().clone()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            held_autocast = engine(input_ids=ids).logits
    out = {
        "autocast_dtypes": [str(tiled_autocast.dtype), str(held_autocast.dtype)],
        "autocast_diff": (tiled_autocast.float() - held_autocast.float()).abs().max().item(),
        "sum": sums,
        "true_sum": full.sum().item(),
        "tiled_vs_held": (tiled_logits - held_logits).abs().max().item(),
        "head": torch.equal(head, full),
        "live_after": engine.stage.gatherer.live_numel(),
    }
    engine.destroy()
    return out


@pytest.mark.multiprocess
def test_other_reads_of_a_tiled_weight_gather_it_whole_and_held_buckets_are_used_as_they_are() -> None:
    for r in run_distributed(_other_reads, world_size=WORLD, timeout=240):
        assert len(r["sum"]) == 1 and r["sum"][0] == pytest.approx(r["true_sum"], rel=1e-6), r
        assert r["tiled_vs_held"] < 1e-5, r
        assert r["autocast_dtypes"] == ["torch.bfloat16"] * 2, r  # computed as autocast computes F.linear
        assert r["autocast_diff"] < 2e-2, r
        assert r["head"]
        assert r["live_after"] == 0, r  # the whole gather was given back when the forward ended


def _out_of_range(rank: int, world: int) -> str:
    import ds_strategy

    model = _llama()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
    assert "Embedding" in {type(tw.module).__name__ for tw in engine.stage.gatherer.unit_map.tiled.values()}
    ids = torch.tensor([[3, 1001, 5]])  # one past the last row, as torch's embedding refuses
    try:
        engine(input_ids=ids)
    except RuntimeError as exc:
        return str(exc)
    finally:
        engine.destroy()
    return "no error"


@pytest.mark.multiprocess
def test_an_id_outside_a_tiled_embedding_raises_as_torch_does() -> None:
    """Not a zero row: the tiles would match no row for it."""
    for message in run_distributed(_out_of_range, world_size=WORLD):
        assert "index out of range in self: Embedding has 1001 rows" in message, message


def _strict(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.accelerator import strict

    assert strict.ACTIVE
    data = _data(world)
    model = _llama()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
    assert engine.stage.gatherer.unit_map.tiled
    losses = _train(engine, model, data, rank, world)
    engine.destroy()
    return {"losses": losses, "reference": _reference(data)}


@pytest.mark.multiprocess
def test_tiles_issue_no_host_collective_under_the_strict_mode() -> None:
    for r in run_distributed(_strict, world_size=WORLD, env=NO_SHM, process_env=STRICT, timeout=300):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["reference"]), rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------------- a rank of 4 under the fake group
def test_a_rank_of_four_runs_tiled_and_never_gathers_the_head_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's fake process group (no data moves: values are not checked): the tiled path of a rank of a
    larger group runs, one tile label per tiled call (embedding, head forward, head backward), and the most
    gathered at once stays below the head. A tiled call takes one buffer, of a gathered block's size (its
    two tiles in flight are its halves), so the host pool serves tiles and blocks from the same buffers."""
    import ds_strategy
    from ds_strategy.runtime import host_memory
    from tests.fake_pg import fake_group

    with fake_group(monkeypatch, world_size=4, rank=1):
        model = _llama()
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
        try:
            gatherer = engine.stage.gatherer
            assert sorted(type(tw.module).__name__ for tw in gatherer.unit_map.tiled.values()) == [
                "Embedding",
                "Linear",
            ]
            ids = torch.randint(0, 1001, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
            labels: list[int] = []
            original = gatherer.tile_label
            monkeypatch.setattr(gatherer, "tile_label", lambda m: labels.append(id(m)) or original(m))
            sizes: list[int] = []  # every gathered buffer's elements, in order
            allocate = host_memory.allocate
            monkeypatch.setattr(host_memory, "allocate", lambda t: sizes.append(t.numel()) or allocate(t))
            per_call: list[int] = []  # buffers taken by each tiled forward
            for m in (model.lm_head, model.model.embed_tokens):
                m.register_forward_pre_hook(lambda *_: per_call.append(-len(sizes)))
                m.register_forward_hook(lambda *_: per_call.append(per_call.pop() + len(sizes)))
            for _ in range(2):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
            head, embed = id(model.lm_head), id(model.model.embed_tokens)
            assert labels == [embed, head, head] * 2, labels
            assert gatherer.peak_live < 32 * 1001
            assert per_call == [1, 1] * 2, per_call
            blocks = {gatherer.numel(k) for mid, keys in gatherer.units.items() for k in keys}
            assert set(sizes) <= blocks, (sorted(set(sizes)), sorted(blocks))
        finally:
            engine.destroy()


def test_idle_host_memory_is_given_back_before_the_loss_and_the_heap_trimmed_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: the loss's peak] in runtime/host_memory.py: on the CPU, the pool's idle buffers and the heap's
    free pages go back before the loss (at the tiled head's exit once the order is recorded, at the start of
    the backward before that), and the heap is trimmed again when the backward takes its first gathered
    buffer; the optimizer step trims nothing (the next forward would fault those pages back in). Nothing of it
    in a forward without gradients."""
    import ds_strategy
    from ds_strategy.runtime import host_memory
    from tests.fake_pg import fake_group

    with fake_group(monkeypatch, world_size=4, rank=1):
        model = _llama()
        params = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=params, config=_config())
        try:
            events: list[str] = []
            give_back, trim_heap = host_memory.give_back_idle, host_memory.trim_heap

            def gave_back() -> None:
                give_back()
                events.append(f"give back (pool caches {host_memory.pool_stats()[1]})")

            monkeypatch.setattr(host_memory, "give_back_idle", gave_back)
            monkeypatch.setattr(host_memory, "trim_heap", lambda: events.append("trim heap") or trim_heap())
            model.lm_head.register_forward_hook(lambda *_: events.append("head"))
            ids = torch.randint(0, 1001, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
            per_step = []
            for _ in range(2):
                loss = engine(input_ids=ids, labels=ids).loss
                events.append("backward")
                engine.backward(loss)
                events.append("step")
                engine.step()
                per_step.append(events[:])
                events.clear()
            with torch.no_grad():
                engine(input_ids=ids, labels=ids)
            no_grad = events[:]
        finally:
            engine.destroy()
    # Step 1 records the order: the backward's start gives back.
    first = ["head", "backward", "trim heap", "give back (pool caches 0)", "trim heap", "step"]
    assert per_step[0] == first, per_step[0]
    # From step 2 the tiled head knows that the forward's stage-3 work is over: before the loss.
    second = ["trim heap", "give back (pool caches 0)", "head", "backward", "trim heap", "step"]
    assert per_step[1] == second, per_step[1]
    assert no_grad == ["head"], no_grad
