"""torch.compile through the engine (issue 24, part 3): compiled stages 0-3 train like eager, the stages'
hooks and collectives add no graph break per layer, later steps compile nothing, and the config block's
keys are acted on or refused.

Backends: "aot_eager" (dynamo + AOTAutograd, the same graphs and compiled backward inductor gets, without
C++ code generation, which takes minutes on 2 cores) where only the graph structure matters, "eager" for
counting graphs and breaks; inductor runs once (stage 3) and in benchmarks/bench_compile.py.

Tolerances: aot_eager runs the eager kernels on the traced graph, so the losses agree to fp32 rounding of
a different op order (rtol 1e-5; observed: identical). Inductor fuses and reorders reductions: rtol 1e-4
(observed ~1e-6 over 4 steps).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_distributed

pytestmark = pytest.mark.multiprocess

STEPS = 4
SHAPE = {"layers": 2, "d": 32, "seq": 8, "micro": 2}


def _train(
    stage: int, compile_block: dict[str, Any] | None, shape: dict[str, int], rank: int, checkpointed: bool = False
) -> dict[str, Any]:
    """STEPS steps of the e2e GPT; losses, and dynamo's graph and break counts after the first and last step."""
    import torch._dynamo
    from benchmarks.training import STAGE3, model_and_batches
    from torch._dynamo.utils import counters

    import ds_strategy

    torch._dynamo.reset()
    counters.clear()
    model, data = model_and_batches(shape, STEPS, rank)
    if checkpointed:  # Lightning's activation_checkpointing_policy={Block}
        from ds_strategy.demo.model import Block
        from ds_strategy.runtime.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, {Block})
    zero: dict[str, Any] = {"stage": stage, **(STAGE3 if stage == 3 else {})}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned: every block gathers
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": shape["micro"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    if compile_block is not None:
        config["compile"] = compile_block
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses, graphs = [], []
    for batch in data:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        graphs.append(counters["stats"]["unique_graphs"])
    out = {
        "losses": losses,
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "break_reasons": list(counters["graph_break"])[:5],
        "is_compiled": engine.is_compiled,
        "regions": len(engine.compiled.regions),
    }
    engine.destroy()
    return out


def _parity(rank: int, world: int, stages: tuple[int, ...], backend: str) -> list[tuple[Any, Any]]:
    return [
        (_train(s, None, SHAPE, rank), _train(s, {"enabled": True, "backend": backend}, SHAPE, rank)) for s in stages
    ]


def _assert_parity(runs: list[Any], stages: tuple[int, ...], rtol: float) -> None:
    for rank_runs in runs:
        for stage, (eager, compiled) in zip(stages, rank_runs, strict=True):
            assert compiled["is_compiled"] and not eager["is_compiled"], stage
            assert compiled["breaks"] == 0, (stage, compiled["break_reasons"])
            torch.testing.assert_close(
                torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=rtol, atol=0, msg=f"stage {stage}"
            )


def test_compiled_stages_match_eager() -> None:
    stages = (0, 1, 2, 3)
    _assert_parity(run_distributed(_parity, 2, args=(stages, "aot_eager"), timeout=600), stages, rtol=1e-5)


def test_inductor_stage3_matches_eager() -> None:
    stages = (3,)
    _assert_parity(run_distributed(_parity, 2, args=(stages, "inductor"), timeout=900), stages, rtol=1e-4)


def _counts(rank: int, world: int, stage: int) -> dict[int, dict[str, Any]]:
    block = {"enabled": True, "backend": "eager"}  # graph capture only: counting needs no code generation
    return {layers: _train(stage, block, {**SHAPE, "layers": layers}, rank) for layers in (2, 6)}


@pytest.mark.parametrize("stage", [2, 3])
def test_graph_breaks_and_compiles_do_not_grow(stage: int) -> None:
    """2 vs 6 blocks: no graph break either way, the same number of graphs (stage 3: one block graph shared by
    every block), and none compiled after the first step (no recompilation as gathered parameters come and go)."""
    for counts in run_distributed(_counts, 2, args=(stage,), timeout=600):
        two, six = counts[2], counts[6]
        assert two["breaks"] == six["breaks"] == 0, (two["break_reasons"], six["break_reasons"])
        assert two["graphs"][-1] == six["graphs"][-1] >= 1
        for run in (two, six):
            assert run["graphs"][0] == run["graphs"][-1], run["graphs"]  # step 1 compiled all there is
        assert (two["regions"], six["regions"]) == ((2, 6) if stage == 3 else (1, 1))


def _errors(rank: int, world: int) -> dict[str, str]:
    from benchmarks.training import model_and_batches

    import ds_strategy

    out = {}
    for name, block in {
        "backend": {"enabled": True, "backend": "no_such_backend"},
        "kwargs": {"enabled": True, "kwargs": {"backend": "eager"}},
    }.items():
        model, _ = model_and_batches(SHAPE, 1, rank)
        config = {"train_micro_batch_size_per_gpu": 2, "compile": block}
        try:
            ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=config)
        except ValueError as err:
            out[name] = str(err)
    return out


def test_bad_backend_and_kwargs_name_the_key() -> None:
    errors = run_distributed(_errors, 2)[0]
    assert "compile.backend" in errors["backend"] and "'no_such_backend'" in errors["backend"]
    assert "inductor" in errors["backend"] and "aot_eager" in errors["backend"]  # the valid names are listed
    assert "compile.kwargs" in errors["kwargs"] and "compile.backend" in errors["kwargs"]


def test_compile_block_is_typed_and_deepcompile_refused() -> None:
    from ds_strategy.config import ConfigError, load_config

    base = {"train_micro_batch_size_per_gpu": 1}
    cfg = load_config({**base, "compile": {"enabled": True, "backend": "aot_eager", "kwargs": {"dynamic": False}}})
    assert (cfg.compile.enabled, cfg.compile.backend, dict(cfg.compile.kwargs)) == (
        True,
        "aot_eager",
        {"dynamic": False},
    )
    assert load_config(base).compile.enabled is False
    for refused in ({"deepcompile": True}, {"passes": ["z3"]}, {"offload_activation": True}):
        with pytest.raises(ConfigError, match=rf"compile\.{next(iter(refused))}"):
            load_config({**base, "compile": refused})


def test_lightning_keyword_writes_the_block() -> None:
    from ds_strategy.lightning import ZeroStrategy

    assert ZeroStrategy(stage=3, compile=True).raw_config["compile"] == {"enabled": True}
    strategy = ZeroStrategy(compile={"backend": "aot_eager"}, config={"compile": {"kwargs": {"dynamic": False}}})
    assert strategy.raw_config["compile"] == {"enabled": True, "backend": "aot_eager", "kwargs": {"dynamic": False}}
    with pytest.raises(ValueError, match=r"compile\.backend"):
        ZeroStrategy(compile={"backend": "eager"}, config={"compile": {"backend": "inductor"}})
    with pytest.raises(ValueError, match="compile="):
        ZeroStrategy(compile="yes")  # type: ignore[arg-type]


def _generate(rank: int, world: int) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import ds_strategy
    from ds_strategy.demo.model import GPT, GPTConfig

    out: dict[str, Any] = {}
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(rank))
    for name, block in {"eager": None, "compiled": {"enabled": True, "backend": "aot_eager"}}.items():
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
        if block is not None:
            config["compile"] = block
        engine, *_ = ds_strategy.initialize(model=model, config=config)
        engine.eval()
        out[name] = engine.generate(prompt, 6, do_sample=False).tolist()
        out[f"{name}_graphs"] = counters["stats"]["unique_graphs"]
        logits = engine(prompt)  # an eval forward afterwards runs the compiled blocks again
        out[f"{name}_logits"] = logits.detach()
        engine.destroy()
        out[f"{name}_restored"] = "forward" not in model.blocks[0].__dict__
    return out


def test_generate_runs_the_eager_forwards() -> None:
    """engine.generate under compile: the original forwards (no graph per decoding length), the same tokens."""
    for got in run_distributed(_generate, 2, timeout=600):
        assert got["compiled"] == got["eager"]
        assert got["compiled_graphs"] == 0  # nothing compiled during generate
        torch.testing.assert_close(got["compiled_logits"], got["eager_logits"], rtol=1e-5, atol=1e-6)
        assert got["compiled_restored"] and got["eager_restored"]  # destroy() put the original forwards back


def _checkpointed(rank: int, world: int, stages: tuple[int, ...]) -> list[tuple[Any, Any]]:
    block = {"enabled": True, "backend": "aot_eager"}
    return [(_train(s, None, SHAPE, rank, True), _train(s, block, SHAPE, rank, True)) for s in stages]


def test_checkpointed_blocks_compile_inside_their_checkpoint() -> None:
    """activation_checkpointing_policy + compile: the checkpoint runs eagerly around each compiled block
    (its stash and RNG replay are not traced), at stage 2 (which would otherwise compile the whole module)
    and stage 3."""
    stages = (2, 3)
    runs = run_distributed(_checkpointed, 2, args=(stages,), timeout=600)
    _assert_parity(runs, stages, rtol=1e-5)
    for rank_runs in runs:
        assert [compiled["regions"] for _, compiled in rank_runs] == [SHAPE["layers"]] * len(stages)
