"""ZeRO-3 leaf modules (runtime/zero/leaf.py): a mixture-of-experts block whose experts are separate modules,
called only for the tokens routed to them, so each rank calls different experts.

At stage 3 on 2 ranks, without marking the block the ranks stop at "ranks diverged at parameter gather";
marked as a leaf (``set_z3_leaf_modules``, or ``zero_optimization.leaf_module`` by class name or by module
name, or marked after the engine is built) it trains like stage 0: fp32 losses and weights within
rtol 1e-5 / atol 1e-6 (measured: losses equal, weights within 4e-7 - the fused optimizer rounds stage 3's
module-aligned chunks in other vector/tail splits), bf16 losses within rtol 1e-5 and weights within one bf16
rounding step (rtol 8e-3, atol 1e-5; measured: bitwise equal). The routing is checked to leave some expert
unused on one rank while the other rank uses it, so the zero-gradient reduction of unused experts is
exercised.
transformers 5.x fuses Mixtral's experts into one module (no divergence possible), so the tiny
MixtralForCausalLM shows the other half: DeepSpeed's default class list marks its sparse MoE blocks from the
config alone, and it trains at stage 3 like stage 0.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import DistributedTestError, run_distributed
from tests.runtime.common import config, engine_run, token_batches

D, HIDDEN, EXPERTS, VOCAB, SEQ = 16, 24, 8, 20, 6
STEPS, MICRO, GAS, WORLD, LR = 6, 2, 2, 2, 1e-2
# Everything partitioned. A marked block is one fetch unit, hence one bucket ([Note: fetch units]); under
# per-module units ("modules") an expert (~800 elements) spans two 500-element buckets.
STAGE3_KEYS = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000}
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routing; each expert runs only on its tokens (as transformers 4.x MoE blocks did)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(EXPERTS)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, D)
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows, None].to(flat.dtype))
        return out.view_as(h)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.ln = nn.LayerNorm(D)
        self.moe = MoEBlock()
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.moe(self.ln(h))
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def make_moe(seed: int = 0) -> MoENet:
    torch.manual_seed(seed)
    return MoENet()


def _config(stage: int, precision: str = "fp32", **zero: Any) -> dict[str, Any]:
    cfg = config(stage=stage, precision=precision, micro=MICRO, gas=GAS, lr=LR, bucket=500)
    if stage == 3:
        cfg["zero_optimization"].update(STAGE3_KEYS)
    cfg["zero_optimization"].update(zero)
    return cfg


def _expert_usage(model: MoENet) -> list[set[int]]:
    """Per forward, the experts this rank called (recorded by forward hooks, which stage 3 leaves alone)."""
    calls: list[set[int]] = []

    def on_root(module: nn.Module, args: Any) -> None:
        calls.append(set())

    model.register_forward_pre_hook(on_root)
    for e, expert in enumerate(model.moe.experts):
        expert.register_forward_pre_hook(lambda m, a, e=e: calls[-1].add(e))
    return calls


# ---------------------------------------------------------------------- the custom MoE block
def _train(rank: int, world: int, how: str, precision: str) -> dict[str, Any]:
    import ds_strategy.runtime as rt
    from ds_strategy.utils import get_z3_leaf_modules, set_z3_leaf_modules

    data = token_batches(STEPS, MICRO * GAS * world, vocab=VOCAB, seq=SEQ)
    model0 = make_moe()
    engine0, *_ = rt.initialize(model=model0, config=_config(0, precision))
    stage0 = engine_run(engine0, data, micro=MICRO, gas=GAS)
    engine0.destroy()

    model = make_moe()
    zero: dict[str, Any] = {}
    if how == "api":
        assert set_z3_leaf_modules(model, [MoEBlock]) == [model.moe]
    elif how == "config-class":
        zero["leaf_module"] = {"classes": ["MoEBlock"]}
    elif how == "config-name":
        zero["leaf_module"] = {"names": ["moe"]}
    usage = _expert_usage(model)
    engine, *_ = rt.initialize(model=model, config=_config(3, precision, **zero))
    if how == "after-build":
        set_z3_leaf_modules(model, ["MoEBlock"])  # takes effect at the next forward
    gatherer = engine.stage.gatherer
    trace = engine_run(engine, data, micro=MICRO, gas=GAS)
    out = {
        "stage0": stage0,
        "stage3": trace,
        "leaves": [name for name, m in model.named_modules() if m in get_z3_leaf_modules(model)],
        "usage": usage,
        "expert_units": [gatherer.units[id(m)] for m in model.moe.experts.modules()],
        "leaf_unit": gatherer.units[id(model.moe)],
        "moe_buckets": gatherer.unit_map.keys_of(list(model.moe.parameters())),
        "live_after": gatherer.live_numel(),
    }
    engine.destroy()
    return out


def _check_routing_differs(ranks: list[dict[str, Any]]) -> None:
    """Some forward calls an expert on one rank that the other rank leaves unused."""
    pairs = zip(ranks[0]["usage"], ranks[1]["usage"], strict=True)
    assert any(a != b for a, b in pairs), "the data must route the ranks' tokens to different experts"
    assert any(len(u) < EXPERTS for r in ranks for u in r["usage"]), "some expert must stay unused on a rank"


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["api", "config-class", "config-name", "after-build"])
def test_leaf_moe_block_trains_like_stage0_fp32(how: str) -> None:
    ranks = run_distributed(_train, world_size=WORLD, args=(how, "fp32"), timeout=300)
    _check_routing_differs(ranks)
    for r in ranks:
        assert r["leaves"] == ["moe"], r["leaves"]
        if how != "after-build":  # built marked: the block's buckets hold nothing else, and nothing but them
            assert r["leaf_unit"] == r["moe_buckets"] and len(r["leaf_unit"]) == 1, r["leaf_unit"]
        else:  # marked later: the unit is the union of the module-aligned buckets of its subtree
            assert set(r["moe_buckets"]) == set(r["leaf_unit"]), r["leaf_unit"]
        assert all(unit == [] for unit in r["expert_units"]), r["expert_units"]
        assert r["live_after"] == 0
        s0, s3 = r["stage0"], r["stage3"]
        torch.testing.assert_close(torch.tensor(s3.losses), torch.tensor(s0.losses), **FP32_TOL)
        for name, value in s0.params.items():
            torch.testing.assert_close(s3.params[name], value, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert ranks[0]["stage3"].losses == ranks[1]["stage3"].losses


@pytest.mark.multiprocess
def test_leaf_moe_block_trains_like_stage0_bf16() -> None:
    ranks = run_distributed(_train, world_size=WORLD, args=("api", "bf16"), timeout=300)
    _check_routing_differs(ranks)
    for r in ranks:
        s0, s3 = r["stage0"], r["stage3"]
        torch.testing.assert_close(torch.tensor(s3.losses), torch.tensor(s0.losses), rtol=1e-5, atol=0.0)
        for name, value in s0.params.items():
            torch.testing.assert_close(s3.params[name], value, rtol=8e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _unmarked(rank: int, world: int) -> None:
    import ds_strategy.runtime as rt

    model = make_moe()
    engine, *_ = rt.initialize(model=model, config=_config(3))
    data = token_batches(STEPS, MICRO * GAS * world, vocab=VOCAB, seq=SEQ)
    engine_run(engine, data, micro=MICRO, gas=GAS)


@pytest.mark.multiprocess
def test_without_leaf_marking_the_ranks_diverge() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_unmarked, world_size=WORLD, timeout=120, env={"DS_STRATEGY_GATHER_TIMEOUT": "10"})
    text = str(info.value)
    assert "ZeRO-3: ranks diverged at parameter gather" in text, text
    assert "moe.experts." in text, text  # the modules named are experts


def _unmark_after_build(rank: int, world: int) -> None:
    import ds_strategy.runtime as rt
    from ds_strategy.zero import set_z3_leaf_modules, unset_z3_leaf_modules

    model = make_moe()
    set_z3_leaf_modules(model, [MoEBlock])
    # Per-module units: unmarked, each expert gathers its own buckets again (under block units the whole
    # block was laid out as one bucket, which every expert would then share).
    engine, *_ = rt.initialize(model=model, config=_config(3, stage3_fetch_units="modules"))
    data = token_batches(STEPS, MICRO * GAS * world, vocab=VOCAB, seq=SEQ)
    engine_run(engine, data[:1], micro=MICRO, gas=GAS)
    unset_z3_leaf_modules(model, [MoEBlock])  # the experts gather on their own again: the ranks diverge
    engine_run(engine, data, micro=MICRO, gas=GAS)


@pytest.mark.multiprocess
def test_unmarking_after_build_takes_effect_at_the_next_forward() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_unmark_after_build, world_size=WORLD, timeout=120, env={"DS_STRATEGY_GATHER_TIMEOUT": "10"})
    assert "ZeRO-3: ranks diverged at parameter gather" in str(info.value), str(info.value)


# ---------------------------------------------------------------------- transformers' Mixtral (fused experts)
class CausalLM(nn.Module):
    """(input ids, labels) -> the loss, the signature engine_run feeds."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=y).loss  # type: ignore[no-any-return]


def make_mixtral(seed: int = 0) -> CausalLM:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    return CausalLM(MixtralForCausalLM(cfg))


def _mixtral(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt
    from ds_strategy.utils import get_z3_leaf_modules, z3_leaf_parameter

    data = token_batches(STEPS, MICRO * GAS * world, vocab=VOCAB, seq=SEQ)
    engine0, *_ = rt.initialize(model=make_mixtral(), config=_config(0))
    stage0 = engine_run(engine0, data, micro=MICRO, gas=GAS)
    engine0.destroy()
    model = make_mixtral()
    engine, *_ = rt.initialize(model=model, config=_config(3))  # no leaf_module key: DeepSpeed's default list
    leaves = [name for name, m in model.named_modules() if m in get_z3_leaf_modules(model)]
    gatherer = engine.stage.gatherer
    block = model.model.model.layers[0].mlp
    out = {
        "leaves": leaves,
        "leaf_params": sorted(n for n, p in model.named_parameters() if z3_leaf_parameter(p)),
        "child_units": [gatherer.units[id(m)] for m in block.modules() if m is not block],
        "stage0": stage0,
        "stage3": engine_run(engine, data, micro=MICRO, gas=GAS),
    }
    engine.destroy()
    return out


@pytest.mark.multiprocess
def test_mixtral_moe_blocks_are_leaves_by_default_and_train_like_stage0() -> None:
    pytest.importorskip("transformers")
    for r in run_distributed(_mixtral, world_size=WORLD, timeout=300):
        assert r["leaves"] == ["model.model.layers.0.mlp", "model.model.layers.1.mlp"], r["leaves"]
        assert r["leaf_params"] == sorted(
            f"model.model.layers.{i}.mlp.{n}"
            for i in (0, 1)
            for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
        )
        assert all(unit == [] for unit in r["child_units"]), r["child_units"]
        s0, s3 = r["stage0"], r["stage3"]
        torch.testing.assert_close(torch.tensor(s3.losses), torch.tensor(s0.losses), **FP32_TOL)
        for name, value in s0.params.items():
            torch.testing.assert_close(s3.params[name], value, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------- the marking API (one process)
def test_set_by_class_name_and_qualified_name_and_subclass() -> None:
    from ds_strategy.utils import get_z3_leaf_modules, set_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter

    class Sub(Expert):
        pass

    model = make_moe()
    model.moe.experts[3] = Sub()
    assert get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules(model, ["Expert"]) == [e for i, e in enumerate(model.moe.experts) if i != 3]
    assert set_z3_leaf_modules(model, [f"{Sub.__module__}.{Sub.__qualname__}"]) == [model.moe.experts[3]]
    assert set_z3_leaf_modules(model, Expert) == list(model.moe.experts)  # a class matches its subclasses
    assert get_z3_leaf_modules(model) == list(model.moe.experts)
    assert z3_leaf_module(model.moe.experts[0]) and not z3_leaf_module(model.moe)
    assert z3_leaf_parameter(model.moe.experts[0].up.weight) and not z3_leaf_parameter(model.moe.router.weight)


def test_unset_and_nested_leaves() -> None:
    from ds_strategy.zero import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_parameter

    model = make_moe()
    set_z3_leaf_modules(model, [MoEBlock, Expert])
    assert get_z3_leaf_modules(model) == [model.moe, *model.moe.experts]
    assert unset_z3_leaf_modules(model, [Expert]) == list(model.moe.experts)
    assert get_z3_leaf_modules(model) == [model.moe]
    assert z3_leaf_parameter(model.moe.experts[0].up.weight)  # still inside the block
    unset_z3_leaf_modules(model, ["MoEBlock"])
    assert get_z3_leaf_modules(model) == []
    assert not any(z3_leaf_parameter(p) for p in model.parameters())


def test_no_match_raises_naming_the_model_classes() -> None:
    from ds_strategy.utils import set_z3_leaf_modules, unset_z3_leaf_modules

    model = make_moe()
    expected = r"no module of MoENet matches \['Mixtral'\]; its module classes are .*MoEBlock"
    with pytest.raises(ValueError, match=expected):
        set_z3_leaf_modules(model, ["Mixtral"])
    with pytest.raises(ValueError, match="unset_z3_leaf_modules: no module of MoENet matches"):
        unset_z3_leaf_modules(model, [nn.Conv2d])
    assert set_z3_leaf_modules(model, ["Mixtral"], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match=r"nn\.Module classes or class names, got \[3\]"):
        set_z3_leaf_modules(model, [3])  # type: ignore[list-item]


def test_by_name_and_by_suffix() -> None:
    from ds_strategy.utils import get_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    model = make_moe()
    assert set_z3_leaf_modules_by_name(model, ["moe", "nope"], raise_if_not_found=False) == ([model.moe], ["nope"])
    with pytest.raises(ValueError, match=r"no module named \['nope'\] in MoENet; .* e\.g\. \[embed, ln, moe"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    set_z3_leaf_modules_by_name(model, ["moe"], flag=False)
    assert get_z3_leaf_modules(model) == []
    found, missing = set_z3_leaf_modules_by_suffix(model, [".up", "zzz"], raise_if_not_found=False)
    assert found == [e.up for e in model.moe.experts] and missing == ["zzz"]
    with pytest.raises(ValueError, match=r"ends with \['zzz'\]"):
        set_z3_leaf_modules_by_suffix(model, ["zzz"])


def test_config_application_skips_absent_defaults_and_logs_unknown_names(caplog: pytest.LogCaptureFixture) -> None:
    from ds_strategy.config import LeafModuleConfig, load_config
    from ds_strategy.runtime.zero.leaf import apply_leaf_module_config

    model = make_moe()
    with caplog.at_level(logging.WARNING, logger="ds_strategy.runtime"):
        assert apply_leaf_module_config(model, load_config({}).zero_optimization.leaf_module) == []
        assert not caplog.records  # DeepSpeed's default classes are not in this model: nothing to say
        cfg = LeafModuleConfig(classes=("MoEBlock",), names=("head", "missing"), name_suffixes=("experts.0",))
        assert apply_leaf_module_config(model, cfg) == [model.moe, model.head, model.moe.experts[0]]
        assert "no module named ['missing']" in caplog.text
        caplog.clear()
        apply_leaf_module_config(model, LeafModuleConfig(classes=("Nothing",)))
        assert "['Nothing'] match no module of the model" in caplog.text
