"""The engine at world size 4 in one process, through torch's fake process group (issue 41, criterion 4).

The fake group runs the real code of one rank of 4 and answers every collective at once without moving
data ([Note: the fake process group] in src/ds_strategy/comm/distributed.py). Values are therefore not
checked; what is: the engine trains without error at stages 1, 2 and 3 (an MLP of blocks in an
nn.ModuleList and a tiny Hugging Face Llama), each rank holds its 1/4 share of the model states
(``engine.memory_breakdown()`` against ``estimate_memory``), and the collectives of a step, counted by the
comms logger, are the same every step after the first. The counts are printed (run with ``-s``) and
attached to the test report (``record_property``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fake_pg import fake_group
from tests.runtime.common import tiny_llama

WORLD = 4
STEPS = 4
MICRO = 2


class Blocks(nn.Module):
    """A few equal Linear blocks in an nn.ModuleList (stage 3's repeated units) and a head."""

    def __init__(self, d: int = 64, n_blocks: int = 4, d_out: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)) for _ in range(n_blocks))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + F.gelu(block(x))
        return F.mse_loss(self.head(x), y)


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        # Threshold 0: every parameter is partitioned at stage 3, however small the model.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "comms_logger": {"enabled": True},
    }


def _blocks_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(MICRO, 64, generator=g), "y": torch.randn(MICRO, 8, generator=g)}


def _llama_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (MICRO, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def _train(engine: Any, batch: Any, steps: int) -> list[Counter[tuple[str, str]]]:
    """Train ``steps`` steps; per step, the collectives the comms logger saw, by (op, path)."""
    g = torch.Generator().manual_seed(1)
    per_step = []
    for _ in range(steps):
        engine.comms_logger.reset()
        out = engine(**batch(g))
        loss = out if isinstance(out, torch.Tensor) else out.loss
        engine.backward(loss)
        engine.step()
        per_step.append(Counter({(s.op, s.path): s.count for s in engine.comms_logger.summary()}))
    return per_step


def _run(model: nn.Module, stage: int, batch: Any) -> tuple[Any, list[Counter[tuple[str, str]]]]:
    import ds_strategy

    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
    try:
        per_step = _train(engine, batch, STEPS)
        return engine.memory_breakdown(), per_step  # after the steps: the optimizer state exists
    finally:
        engine.destroy()


def _check_run(
    stage: int,
    expected: Any,
    memory: dict[str, int],
    per_step: list[Counter[tuple[str, str]]],
    record_property: Any,
    what: str,
) -> None:
    print(f"\n{what}: collectives per step {[dict(c) for c in per_step]}")
    record_property("collectives_per_step", [sorted(c.items()) for c in per_step])
    # (b) the collectives of a step: some, every one through the fake group, the same from step 2 on.
    assert all(sum(c.values()) > 0 for c in per_step), per_step
    assert {path for c in per_step for _, path in c} == {"fake"}, per_step
    steady = per_step[1:]
    assert all(c == steady[0] for c in steady), f"the collectives differ from step to step: {per_step}"
    ops = {op for op, _ in steady[0]}
    assert "reduce_scatter" in ops, ops  # stages 1-3 reduce-scatter the gradients
    if stage == 3:
        assert "all_gather" in ops, ops  # and stage 3 gathers its partitioned parameters every step
    # (a) what this rank holds: its 1/4 share (estimate_memory's table, which the engine matches).
    for kind in ("params", "optimizer_state") + (("grads",) if stage < 3 else ()):
        assert memory[kind] == pytest.approx(getattr(expected, kind), rel=0.02), (kind, memory, expected)
    assert memory.get("gathered_params", 0) == 0, memory


@pytest.mark.parametrize(
    ("stage", "rank"), [(1, 0), (2, 0), (3, 0), (3, WORLD - 1)], ids=["stage1", "stage2", "stage3", "stage3-rank3"]
)
def test_blocks_train_at_fake_world_size_4(
    monkeypatch: pytest.MonkeyPatch, record_property: Any, stage: int, rank: int
) -> None:
    from ds_strategy.runtime.memory import estimate_memory

    torch.manual_seed(0)
    model = Blocks()
    expected = estimate_memory(model, WORLD, stage, device="cpu", optimizer="AdamW")
    with fake_group(monkeypatch, world_size=WORLD, rank=rank):
        import torch.distributed as dist

        memory, per_step = _run(model, stage, _blocks_batch)
        assert dist.get_world_size() == WORLD
    if stage == 3:  # at rest: a quarter of the fp32 weights, not the whole model
        whole = sum(p.numel() for p in Blocks().parameters()) * 4
        assert memory["params"] < whole / 2, (memory, whole)
    _check_run(stage, expected, memory, per_step, record_property, f"Blocks stage {stage} rank {rank}")


@pytest.mark.parametrize("stage", [2, 3], ids=["stage2", "stage3"])
def test_hf_llama_trains_at_fake_world_size_4(
    monkeypatch: pytest.MonkeyPatch, record_property: Any, stage: int
) -> None:
    from ds_strategy.runtime.memory import estimate_memory

    model = tiny_llama()
    expected = estimate_memory(model, WORLD, stage, device="cpu", optimizer="AdamW")
    with fake_group(monkeypatch, world_size=WORLD, rank=1):
        memory, per_step = _run(model, stage, _llama_batch)
    _check_run(stage, expected, memory, per_step, record_property, f"Llama stage {stage}")


def test_engine_sees_the_fake_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's communicator knows it has no peers and opened no shared-memory path, and the engine's
    ranks are the group's."""
    import ds_strategy

    torch.manual_seed(0)
    model = Blocks(n_blocks=1)
    with fake_group(monkeypatch, world_size=WORLD, rank=2):
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=_config(2))
        try:
            assert (engine.dp_world_size, engine.dp_rank) == (WORLD, 2)
            assert engine.coll.is_fake and not engine.coll.has_peers
            assert engine.coll.fast_path is None
        finally:
            engine.destroy()


def test_reductions_land_as_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of a fake group frees each reduction's staging buffer when the next one launches, as a real
    rank does once its reduce-scatters land: with DeepSpeed's default ``reduce_bucket_size`` (5e8) nothing
    else bounds the reductions in flight, and torch's fake work never reports itself completed."""
    from ds_strategy.runtime.zero.reducer import GradientReducer

    in_flight: list[int] = []
    launch = GradientReducer._launch_next

    def counted(self: GradientReducer) -> None:
        launch(self)
        in_flight.append(len(self._inflight))

    monkeypatch.setattr(GradientReducer, "_launch_next", counted)
    torch.manual_seed(0)
    with fake_group(monkeypatch, world_size=WORLD):
        _run(Blocks(n_blocks=6), 3, _blocks_batch)
    assert len(in_flight) >= 6 * STEPS, in_flight  # a bucket per block (and the rest) each step
    assert max(in_flight) == 0, in_flight


class _WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.temperature = nn.Parameter(torch.tensor(1.0))  # 0-dimensional


def test_partitioned_parameters_keep_their_dimensions_and_tell_their_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter partitioned by ``zero.Init`` holds 0 elements but keeps its number of dimensions, so the
    usual "decay matrices only" split (``p.ndim >= 2``) in configure_optimizers groups it as a plain build
    does; it and every stage-3 parameter carry DeepSpeed's ``ds_shape`` / ``ds_numel``."""
    import ds_strategy
    from ds_strategy import zero

    plain = _WithScalar()
    with fake_group(monkeypatch, world_size=WORLD):
        with zero.Init():
            built = _WithScalar()
        for (name, p), q in zip(built.named_parameters(), plain.parameters(), strict=True):
            assert p.numel() == 0 and p.ndim == max(1, q.ndim), name
            assert (p.ds_shape, p.ds_numel) == (q.shape, q.numel()), name
        assert [p.ndim >= 2 for p in built.parameters()] == [q.ndim >= 2 for q in plain.parameters()]
        torch.manual_seed(0)
        model = Blocks(n_blocks=2)
        shapes = {n: (p.shape, p.numel()) for n, p in model.named_parameters()}
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
        try:
            for name, p in model.named_parameters():
                assert p.numel() == 0, name  # partitioned: a placeholder between fetches
                assert (p.ds_shape, p.ds_numel) == shapes[name], name
        finally:
            engine.destroy()
