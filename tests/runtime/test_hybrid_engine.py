"""The hybrid engine (issue 23, criterion 1): ``engine.generate`` under stages 0-3, stage 3 gathering the
model once per call (``hybrid_engine.enabled``), pinning until the next step, the memory rule, the config.

References: greedy generation of the same model in one process (what DDP generates on each rank: DDP's
module is the whole model), and a torch DDP run of the same generate-train-generate loop.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import llama_prompt, runtime_log_messages, tiny_llama

pytestmark = pytest.mark.multiprocess

NEW = 6  # tokens generated per call


def _gpt() -> Any:
    from ds_strategy.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))


def _prompt(rank: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, 4), generator=torch.Generator().manual_seed(10 + rank))


def _config(stage: int, hybrid: dict[str, Any] | None = None, **zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    if hybrid is not None:
        cfg["hybrid_engine"] = hybrid
    return cfg


def _partitioned_buckets(engine: Any) -> int:
    return sum(len(gs.full) - len(gs.persistent) for gs in getattr(engine.stage, "storages", []))


def _module_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _generate_each_way(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    expected = _gpt().eval().generate(_prompt(rank), NEW, do_sample=False)
    ways = {
        "stage0": _config(0),
        "stage2": _config(2),
        "stage3-plain": _config(3),
        "stage3-hybrid": _config(3, {"enabled": True, "pin_parameters": False}),
        "stage3-hybrid-pinned": _config(3, {"enabled": True, "pin_parameters": True}),
    }
    out: dict[str, Any] = {"expected": expected}
    for name, cfg in ways.items():
        model = _gpt()
        engine, *_ = ds_strategy.initialize(model=model, config=cfg)
        engine.eval()
        assert not model.training and not model.blocks[0].attn.training  # eval() reaches every submodule
        gatherer = getattr(engine.stage, "gatherer", None)
        before = gatherer.gathers if gatherer is not None else 0
        got = engine.generate(_prompt(rank), NEW, do_sample=False)
        out[name] = {
            "got": got,
            "gathers": (gatherer.gathers - before) if gatherer is not None else 0,
            "buckets": _partitioned_buckets(engine),
            "units": sum(1 for keys in gatherer.units.values() if keys) if gatherer is not None else 0,
            "smallest_param_after": min(p.numel() for p in model.parameters()),
            "gathered_bytes": engine.memory_breakdown()["gathered_params"],
            "full_bytes": sum(p.numel() for p in _gpt().parameters()) * 4,
        }
        # Module hooks: removed for a held call (torch's fast path), back after it (pinned: after the release).
        hooks_before = _module_hooks(model)
        during = engine.generate(_prompt(rank), generate_fn=lambda prompt, m=model: _module_hooks(m))
        after = _module_hooks(model)
        engine.hybrid.release()
        out[name]["hooks"] = (hooks_before, during, after, _module_hooks(model))
        engine.train()
        assert model.training
        engine.destroy()
    return out


def test_generate_equals_single_process_and_hybrid_gathers_once_per_bucket() -> None:
    for r in run_distributed(_generate_each_way, world_size=2, timeout=180):
        for name in ("stage0", "stage2", "stage3-plain", "stage3-hybrid", "stage3-hybrid-pinned"):
            torch.testing.assert_close(r[name]["got"], r["expected"], rtol=0, atol=0, msg=name)
        plain, hybrid, pinned = r["stage3-plain"], r["stage3-hybrid"], r["stage3-hybrid-pinned"]
        # One all-gather per partitioned bucket for the whole call ...
        assert hybrid["buckets"] > 0 and hybrid["gathers"] == hybrid["buckets"], hybrid
        assert pinned["gathers"] == pinned["buckets"], pinned
        # ... against every bucket at every decoding step through the hooks.
        assert plain["gathers"] >= NEW * hybrid["gathers"] and plain["units"] > 0, plain
        # Released after the call (back to 0-element shards), unless pinned: then the whole model is held.
        assert plain["smallest_param_after"] == 0 and hybrid["smallest_param_after"] == 0
        assert hybrid["gathered_bytes"] == 0 and plain["gathered_bytes"] == 0
        assert pinned["smallest_param_after"] > 0
        # Held copy: every parameter in fp32, tied head counted once, plus bucket padding (< 1 element/rank each).
        assert pinned["full_bytes"] <= pinned["gathered_bytes"] <= pinned["full_bytes"] + 4 * 2 * pinned["buckets"]
        assert r["stage0"]["gathered_bytes"] == 0
        # The hooks stand aside for a held call and come back with the release; plain stage 3 keeps them.
        assert plain["hooks"][0] > 0 and plain["hooks"] == (plain["hooks"][0],) * 4, plain["hooks"]
        assert hybrid["hooks"] == (plain["hooks"][0], 0, plain["hooks"][0], plain["hooks"][0]), hybrid["hooks"]
        assert pinned["hooks"] == (0, 0, 0, plain["hooks"][0]), pinned["hooks"]


def _loop(engine_or_ddp: Any, rank: int, *, engine: bool) -> dict[str, Any]:
    """generate -> train on the generated sequences -> generate, twice; the tokens of every generate."""
    model = engine_or_ddp.module
    optimizer = None
    if not engine:
        optimizer = torch.optim.AdamW(engine_or_ddp.parameters(), lr=0.05)
    tokens, held = [], []
    for _ in range(2):
        engine_or_ddp.eval()
        seq = (engine_or_ddp if engine else model).generate(_prompt(rank), NEW, do_sample=False)
        tokens.append(seq)
        if engine:
            held.append(engine_or_ddp.memory_breakdown()["gathered_params"])
        engine_or_ddp.train()
        logits = engine_or_ddp(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), seq[:, 1:].reshape(-1))
        if engine:
            engine_or_ddp.backward(loss)
            engine_or_ddp.step()
            held.append(engine_or_ddp.memory_breakdown()["gathered_params"])
        else:
            assert optimizer is not None
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    engine_or_ddp.eval()
    tokens.append((engine_or_ddp if engine else model).generate(_prompt(rank), NEW, do_sample=False))
    return {"tokens": tokens, "held": held}


def _generate_train_generate(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import ds_strategy

    out = {"ddp": _loop(DistributedDataParallel(_gpt()), rank, engine=False)}
    for name, hybrid in {
        "plain": None,
        "hybrid": {"enabled": True, "pin_parameters": False},
        "pinned": {"enabled": True, "pin_parameters": True, "release_inference_cache": True},
    }.items():
        engine, *_ = ds_strategy.initialize(model=_gpt(), config=_config(3, hybrid))
        out[name] = _loop(engine, rank, engine=True)
        out[name]["cycle"] = dict(engine.hybrid.last_cycle)  # eval() closed a train/generate cycle
        engine.destroy()
    return out


def test_generate_train_generate_matches_ddp() -> None:
    for r in run_distributed(_generate_train_generate, world_size=2, timeout=180):
        reference = r["ddp"]["tokens"]
        assert not torch.equal(reference[0], reference[2])  # training changed what is generated: staleness shows
        for name in ("plain", "hybrid", "pinned"):
            for got, want in zip(r[name]["tokens"], reference, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        # Pinned: held after each generate (and through the training forward), released by the step.
        held = r["pinned"]["held"]
        assert held[0] > 0 and held[1] == 0 and held[2] > 0 and held[3] == 0, held
        assert r["hybrid"]["held"] == [0, 0, 0, 0]
        cycle = r["hybrid"]["cycle"]
        assert cycle["training"] > 0 and cycle["generate"] > 0 and cycle["gather"] > 0
        assert cycle["latency"] >= cycle["training"] + cycle["generate"] + cycle["gather"]


def _hf_generate(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    new = 3 + 4 * rank  # the ranks generate different lengths
    expected = tiny_llama().generate(llama_prompt(rank), max_new_tokens=new, do_sample=False)
    out: dict[str, Any] = {"expected": expected}
    for name, hybrid, synced in (
        ("plain-synced", None, True),
        ("hybrid-unsynced", {"enabled": True, "pin_parameters": False}, False),
    ):
        model = tiny_llama()
        engine, *_ = ds_strategy.initialize(model=model, config=_config(3, hybrid))
        engine.eval()
        before = engine.stage.gatherer.gathers
        got = engine.generate(llama_prompt(rank), max_new_tokens=new, do_sample=False, synced_gpus=synced)
        out[name] = {
            "got": got,
            "gathers": engine.stage.gatherer.gathers - before,
            "buckets": _partitioned_buckets(engine),
            "at_rest": min(p.numel() for p in model.parameters()),
        }
        engine.destroy()
    return out


def test_hf_llama_hybrid_generates_uneven_lengths_without_synced_gpus() -> None:
    for rank, r in enumerate(run_distributed(_hf_generate, world_size=2, timeout=180)):
        assert r["expected"].shape[1] == 5 + rank + 3 + 4 * rank
        for name in ("plain-synced", "hybrid-unsynced"):
            torch.testing.assert_close(r[name]["got"], r["expected"], rtol=0, atol=0, msg=name)
            assert r[name]["at_rest"] == 0
        assert r["hybrid-unsynced"]["gathers"] == r["hybrid-unsynced"]["buckets"]
        assert r["plain-synced"]["gathers"] > 5 * r["hybrid-unsynced"]["gathers"]


def _rules(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    out: dict[str, Any] = {}
    # max_out_tokens: prompt (4) + new tokens above it raise, naming the key; at the limit it runs.
    engine, *_ = ds_strategy.initialize(
        model=_gpt(), config=_config(3, {"enabled": True, "max_out_tokens": 8, "pin_parameters": False})
    )
    with pytest.raises(ValueError, match=r"hybrid_engine\.max_out_tokens is 8") as err:
        engine.generate(_prompt(rank), 5, do_sample=False)
    out["error"] = str(err.value)
    out["at_limit"] = engine.generate(_prompt(rank), max_new_tokens=4, do_sample=False).shape
    # generate_fn: any function, run with the parameters gathered once.
    gatherer = engine.stage.gatherer
    before = gatherer.gathers
    out["fn"] = engine.generate(_prompt(rank), generate_fn=lambda p: engine.module(p).argmax(-1))
    out["fn_gathers"] = gatherer.gathers - before
    out["buckets"] = _partitioned_buckets(engine)
    engine.destroy()

    # tp_gather_partition_size: bucket all-gathers in flight together in the one-time gather.
    engine, *_ = ds_strategy.initialize(
        model=_gpt(), config=_config(3, {"enabled": True, "tp_gather_partition_size": 3, "pin_parameters": False})
    )
    chunks: list[int] = []
    acquire = engine.stage.gatherer.acquire
    engine.stage.gatherer.acquire = lambda keys, label: (chunks.append(len(keys)), acquire(keys, label))[1]
    engine.generate(_prompt(rank), 2, do_sample=False)
    out["chunks"] = list(chunks)  # destroy gathers one bucket at a time afterwards
    out["buckets_tp"] = _partitioned_buckets(engine)
    engine.destroy()

    # The memory rule: a model above stage3_max_live_parameters generates through the hooks, with a warning.
    with runtime_log_messages() as records:
        engine, *_ = ds_strategy.initialize(
            model=_gpt(), config=_config(3, {"enabled": True}, stage3_max_live_parameters=20_000)
        )
        before = engine.stage.gatherer.gathers
        out["fallback"] = engine.generate(_prompt(rank), NEW, do_sample=False)
        out["fallback_gathers"] = engine.stage.gatherer.gathers - before
        out["fallback_held"] = engine.stage.placement.holding
        engine.destroy()
    out["warnings"] = [m for m in records if "hybrid_engine" in m]

    # release_inference_cache: the host pool's cached gathered-bucket buffers are returned after the call.
    from ds_strategy.runtime import host_memory

    for release in (False, True):
        hybrid = {"enabled": True, "pin_parameters": False, "release_inference_cache": release}
        engine, *_ = ds_strategy.initialize(model=_gpt(), config=_config(3, hybrid))
        engine.generate(_prompt(rank), 2, do_sample=False)
        out[f"pool_cached_{release}"] = host_memory.pool_stats()[1]
        engine.destroy()
    out["expected"] = _gpt().eval().generate(_prompt(rank), NEW, do_sample=False)
    return out


def test_max_out_tokens_generate_fn_partition_size_and_memory_rule() -> None:
    for rank, r in enumerate(run_distributed(_rules, world_size=2, timeout=180)):
        assert "9 tokens requested" in r["error"]
        assert r["at_limit"] == (2, 8)
        assert r["fn"].shape == (2, 4) and r["fn_gathers"] == r["buckets"]
        n = r["buckets_tp"]
        assert r["chunks"] == [3] * (n // 3) + ([n % 3] if n % 3 else []), r["chunks"]
        torch.testing.assert_close(r["fallback"], r["expected"], rtol=0, atol=0)
        assert r["fallback_gathers"] > r["buckets"] and not r["fallback_held"]
        assert len(r["warnings"]) == (1 if rank == 0 else 0), r["warnings"]  # once, on rank 0
        assert all("stage3_max_live_parameters (20000)" in m for m in r["warnings"])
        assert r["pool_cached_False"] > 0 and r["pool_cached_True"] == 0


def test_config_accepts_tensor_parallel_generation_and_types_the_block() -> None:
    from ds_strategy.config import ConfigError, load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"inference_tp_size": 2}}, world_size=2)
    assert cfg.hybrid_engine.inference_tp_size == 2
    with pytest.raises(ConfigError, match=r"hybrid_engine\.inference_tp_size"):
        load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"inference_tp_size": 0}}, world_size=1)
    with pytest.raises(ConfigError, match=r"hybrid_engine\.max_out_tokens"):
        load_config({"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"max_out_tokens": 0}}, world_size=1)
    cfg = load_config(
        {"train_micro_batch_size_per_gpu": 1, "hybrid_engine": {"enabled": True, "pin_parameters": False}},
        world_size=1,
    )
    assert cfg.hybrid_engine.enabled and not cfg.hybrid_engine.pin_parameters
    assert cfg.hybrid_engine.max_out_tokens == 512 and cfg.hybrid_engine.tp_gather_partition_size == 8


TP = {"enabled": True, "pin_parameters": False, "inference_tp_size": 2}


def _generate_split(engine: Any, model: Any, rank: int) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor]:
    """Greedy tokens; the (rows of the MLP's first weight, batch) seen inside the call; the joint batch a
    sampling call generated (both ranks of the group must sample it alike: one seed per call)."""
    widths: list[tuple[int, int]] = []
    hook = (
        model.blocks[0].mlp[0].register_forward_hook(lambda m, i, o: widths.append((m.weight.shape[0], i[0].shape[0])))
    )
    got = engine.generate(_prompt(rank), NEW, do_sample=False)
    hook.remove()
    joint: list[torch.Tensor] = []
    engine.generate(_prompt(rank), NEW, generate_fn=lambda p, n: joint.append(model.generate(p, n)) or p)
    return got, widths, joint[0]


def _tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.config import ConfigError

    out: dict[str, Any] = {"expected": _gpt().eval().generate(_prompt(rank), NEW, do_sample=False)}
    for name, cfg in (
        ("stage2", _config(2, TP)),
        ("stage3", _config(3, TP)),
        ("stage3-pinned", _config(3, {**TP, "pin_parameters": True})),
    ):
        model = _gpt()
        engine, *_ = ds_strategy.initialize(model=model, config=cfg)
        engine.eval()
        got, widths, joint = _generate_split(engine, model, rank)
        out[name] = {
            "got": got,
            "widths": sorted(set(widths)),
            "restored": [tuple(p.shape) for p in model.parameters()],
            "sampled": joint,
        }
        engine.train()  # a training step after generating: the weights are whole again
        loss = engine(_prompt(rank)).float().mean()
        engine.backward(loss)
        engine.step()
        out[name]["trained"] = True
        engine.destroy()

    # A wrapper without a plan of its own (a LightningModule holding the GPT) takes the GPT's, prefixed.
    wrapper = torch.nn.Module()
    wrapper.gpt = _gpt()
    engine, *_ = ds_strategy.initialize(model=wrapper, config=_config(3, TP))
    out["wrapped"] = engine.generate(_prompt(rank), NEW, do_sample=False, generate_fn=wrapper.gpt.generate)
    out["wrapped_splits"] = [s.name for s in engine.hybrid.tensor_parallel.splits][:2]
    engine.destroy()

    # Above the memory rule stage 3 gathers module by module, which would overwrite the slices: it generates
    # data-parallel instead, with one warning on rank 0.
    with runtime_log_messages() as records:
        engine, *_ = ds_strategy.initialize(model=_gpt(), config=_config(3, TP, stage3_max_live_parameters=20_000))
        out["fallback"] = engine.generate(_prompt(rank), NEW, do_sample=False)
        engine.destroy()
    out["fallback_warnings"] = [m for m in records if "generating data-parallel instead" in m]

    # Prompts of different shapes in one group: every rank raises (no hang).
    engine, *_ = ds_strategy.initialize(model=_gpt(), config=_config(3, TP))
    with pytest.raises(ValueError, match="different shapes") as err:
        engine.generate(_prompt(rank, batch=1 + rank), 2, do_sample=False)
    out["shape_error"] = str(err.value)
    engine.destroy()
    # A model without a plan, or a size that does not divide the ranks: a ConfigError naming the key.
    errors = []
    for model, size in ((torch.nn.Sequential(torch.nn.Linear(4, 4)), 2), (_gpt(), 3)):
        with pytest.raises(ConfigError, match=r"hybrid_engine\.inference_tp_size") as err:
            ds_strategy.initialize(model=model, config=_config(3, {**TP, "inference_tp_size": size}))
        errors.append(str(err.value))
    out["config_errors"] = errors
    return out


def test_tensor_parallel_generation_equals_single_process_with_half_the_weights() -> None:
    results = run_distributed(_tensor_parallel, world_size=2, timeout=180)
    for r in results:
        for name in ("stage2", "stage3", "stage3-pinned"):
            got = r[name]
            torch.testing.assert_close(got["got"], r["expected"], rtol=0, atol=0, msg=name)
            # Inside the call: half of the 128 hidden units per rank, the two ranks' prompts as one batch.
            assert got["widths"] == [(64, 4)], (name, got["widths"])
            assert got["trained"]
        assert r["stage2"]["restored"] == [tuple(p.shape) for p in _gpt().parameters()]
        assert all(shape == (0,) for shape in r["stage3"]["restored"])  # back to 0-element shards
        torch.testing.assert_close(r["fallback"], r["expected"], rtol=0, atol=0)
        torch.testing.assert_close(r["wrapped"], r["expected"], rtol=0, atol=0)
        assert r["wrapped_splits"] == ["gpt.blocks.0.attn", "gpt.blocks.0.attn.out_proj"], r["wrapped_splits"]
        assert len(r["fallback_warnings"]) == (1 if r is results[0] else 0), r["fallback_warnings"]
        assert "pad the prompts" in r["shape_error"]
        assert "has no tensor-parallel plan" in r["config_errors"][0]
        assert "3 does not divide the 2 ranks" in r["config_errors"][1]
    for name in ("stage2", "stage3", "stage3-pinned"):
        torch.testing.assert_close(results[0][name]["sampled"], results[1][name]["sampled"], rtol=0, atol=0)
        assert results[0][name]["sampled"].shape == (4, 4 + NEW)


def _hf_tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(prompt)
    expected = tiny_llama().generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)
    model = tiny_llama()
    engine, *_ = ds_strategy.initialize(model=model, config=_config(3, TP))
    engine.eval()
    rows: list[int] = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: rows.append(m.weight.shape[1]))
    got = engine.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False)
    hook.remove()
    dict_out = engine.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    engine.destroy()
    families = {}
    for family in ("gpt_neox", "phi3", "gemma", "qwen2"):  # fused qkv; rowwise_split_input; head_dim; biases
        expected_f = _hf_family(family).generate(prompt, max_new_tokens=4, do_sample=False)
        engine, *_ = ds_strategy.initialize(model=_hf_family(family), config=_config(3, TP))
        families[family] = torch.equal(engine.generate(prompt, max_new_tokens=4, do_sample=False), expected_f)
        engine.destroy()
    return {
        "expected": expected,
        "got": got,
        "rows": sorted(set(rows)),
        "sequences": dict_out.sequences,
        "families": families,
    }


def _hf_family(family: str) -> Any:
    """A tiny Hugging Face causal LM of ``family`` (4 heads, 2 layers, seed 0) that never stops early."""
    transformers = pytest.importorskip("transformers")
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    common = {"vocab_size": 64, "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": None}
    config = {
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**sizes, **common),
        "phi3": lambda: transformers.Phi3Config(**sizes, num_key_value_heads=2, **common),
        "gemma": lambda: transformers.GemmaConfig(**sizes, num_key_value_heads=2, head_dim=8, **common),
        "qwen2": lambda: transformers.Qwen2Config(**sizes, num_key_value_heads=2, **common),
    }[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def test_hf_llama_generates_tensor_parallel_from_its_own_plan() -> None:
    for r in run_distributed(_hf_tensor_parallel, world_size=2, timeout=180):
        torch.testing.assert_close(r["got"], r["expected"], rtol=0, atol=0)
        assert r["rows"] == [32]  # down_proj reads half of the 64 intermediate features per rank
        torch.testing.assert_close(r["sequences"], r["expected"][:, :7], rtol=0, atol=0)
        assert r["families"] == {"gpt_neox": True, "phi3": True, "gemma": True, "qwen2": True}, r["families"]


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    engine, *_ = ds_strategy.initialize(model=_gpt(), config=_config(3, TP))
    engine.eval()
    got = engine.generate(_prompt(rank), NEW, do_sample=False)
    group = engine.hybrid.tensor_parallel.comm.group
    members = torch.distributed.get_process_group_ranks(group)
    engine.destroy()
    return {"got": got, "expected": _gpt().eval().generate(_prompt(rank), NEW, do_sample=False), "group": members}


def test_tensor_parallel_groups_are_consecutive_ranks_of_four() -> None:
    for rank, r in enumerate(run_distributed(_four_ranks, world_size=4, timeout=180)):
        torch.testing.assert_close(r["got"], r["expected"], rtol=0, atol=0)
        assert r["group"] == ([0, 1] if rank < 2 else [2, 3])


def _no_generate(rank: int, world: int) -> str:
    import ds_strategy

    engine, *_ = ds_strategy.initialize(model=torch.nn.Linear(4, 4), config=_config(3, {"enabled": True}))
    try:
        engine.generate(torch.zeros(1, 4))
    except TypeError as err:
        return str(err)
    finally:
        engine.destroy()
    return ""


def test_module_without_generate_names_generate_fn() -> None:
    for message in run_distributed(_no_generate, world_size=2):
        assert "has no generate method" in message and "generate_fn" in message
