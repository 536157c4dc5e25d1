"""Per-tensor optimizers (Muon, Adafactor) under ZeRO stages 0-3: [Note: per-tensor optimizers under ZeRO].

Layout: with ``whole_params`` every parameter lies whole in one rank's shard, the ranks' loads are balanced
largest-first, and the padding between ranks' runs is reported as gaps (the stage zeroes them).

Parity: on 2 and 4 ranks, fp32, two micro-steps of accumulation, each optimizer trains a small language
model (an embedding, Linear + LayerNorm blocks, an untied head) like one process running the same torch
optimizer on the whole global batch: losses within 1e-5 (relative), weights within 2e-5 (absolute) after
4 steps. The reference differs only in the order gradients are summed (one backward over the whole batch
against per-rank backwards summed by the collective); a step on bucket fragments (what an element-wise
layout would do) differs by orders of magnitude more, as the control case shows. Muon's Newton-Schulz
iteration runs in bf16 inside torch.optim.Muon on both sides.
Checkpoints: per-tensor state saved on 2 ranks at stage 2 loads on 4 ranks at stage 3 (and the other way) and
training continues as the uninterrupted run does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.runtime.layout import FlatLayout
from tests.harness import run_distributed

VOCAB, D, BLOCKS, T = 32, 16, 3, 6
MICRO, GAS, STEPS = 2, 2, 4
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 2e-5


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D)) for _ in range(BLOCKS))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), target.reshape(-1))


def _data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = MICRO * GAS * world
    return [
        (torch.randint(0, VOCAB, (rows, T), generator=g), torch.randint(0, VOCAB, (rows, T), generator=g))
        for _ in range(STEPS + 2)
    ]


def _slice(batch: tuple[torch.Tensor, torch.Tensor], world: int, m: int, rank: int) -> tuple[torch.Tensor, ...]:
    start = (m * world + rank) * MICRO
    return tuple(t[start : start + MICRO] for t in batch)


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _muon_groups(model: nn.Module) -> list[dict[str, Any]]:
    from ds_strategy.runtime.muon import embedding_ids, split_for_muon

    return split_for_muon([{"params": list(model.parameters())}], embedding_ids(model))


# name -> (optimizer factory over a model, config "optimizer" block or None)
def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer | None:
    from ds_strategy import MuonWithAuxAdam

    kind = kind.removesuffix("+offload")
    if kind == "muon":
        return MuonWithAuxAdam(_muon_groups(model), lr=0.02, adam_lr=3e-3, weight_decay=0.01)
    if kind == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    if kind == "torch_muon":  # torch's Muon alone: the matrices train, the rest is frozen
        return torch.optim.Muon([p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n], lr=0.02)
    if kind == "muon_config":
        return None
    raise AssertionError(kind)


def _freeze_for(kind: str, model: nn.Module) -> None:
    if kind == "torch_muon":
        for n, p in model.named_parameters():
            p.requires_grad_(p.ndim == 2 and "emb" not in n)


def _config(stage: int, kind: str, bucket: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,  # the references are unclipped torch optimizers
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_param_persistence_threshold": 0,
        },
    }
    if kind.endswith("+offload"):  # the masters on the host, stepped there by the client optimizer
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if kind == "muon_config":
        cfg["optimizer"] = {
            "type": "Muon",
            "params": {"lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01},
        }
    return cfg


def _reference(kind: str, data: list[Any], steps: int) -> dict[str, Any]:
    model = _model()
    _freeze_for(kind, model)
    opt = _optimizer("muon" if kind == "muon_config" else kind.removesuffix("+offload"), model)
    assert opt is not None
    losses = []
    for batch in data[:steps]:
        loss = model(*batch)
        loss.backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _engine(stage: int, kind: str, bucket: int, *, init: bool = False) -> Any:
    import ds_strategy

    if init:
        with ds_strategy.zero.Init(config_dict_or_path=_config(stage, kind, bucket)):
            model = _model()
    else:
        model = _model()
    _freeze_for(kind, model)
    engine, _, _, _ = ds_strategy.initialize(
        model=model, optimizer=_optimizer(kind, model), config=_config(stage, kind, bucket)
    )
    return engine


def _train(engine: Any, data: list[Any]) -> list[float]:
    import torch.distributed as dist

    losses = []
    world, rank = engine.dp_world_size, engine.dp_rank
    for batch in data:
        total = torch.zeros(())
        for m in range(GAS):
            loss = engine(*_slice(batch, world, m, rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (GAS * world))
    return losses


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    from ds_strategy.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _parity(rank: int, world: int, cases: list[tuple[int, str, int, bool]]) -> list[dict[str, Any]]:
    data = _data(world)
    out = []
    for stage, kind, bucket, init in cases:
        engine = _engine(stage, kind, bucket, init=init)
        # the per-tensor groups lie whole (MuonWithAuxAdam's AdamW groups stay flat: element-wise)
        wholes = sorted(engine.stage.whole.groups)
        groups = [engine.stage.groups[g] for g in wholes]
        whole = bool(groups) and all(gs.layout.owner(i) is not None for gs in groups for i in range(len(gs.params)))
        losses = _train(engine, data[:STEPS])
        out.append(
            {
                "case": (stage, kind, bucket, init),
                "losses": losses,
                "params": _weights(engine),
                "whole": whole,
                "stepped": sum(len(engine.stage.whole.names[g]) for g in wholes),
                "trainable": sum(len(gs.params) for gs in groups),
                "flat": [g for g in range(len(engine.stage.groups)) if g not in engine.stage.whole.groups],
            }
        )
        engine.destroy()
    return out


def _check(results: list[list[dict[str, Any]]], world: int) -> None:
    for per_case in zip(*results, strict=True):
        stage, kind, _, _ = per_case[0]["case"]
        ref = _reference(kind, _data(world), STEPS)
        for r in per_case:
            assert r["whole"], r["case"]
            assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), r["case"]
            for name, value in ref["params"].items():
                diff = (r["params"][name] - value).abs().max().item()
                assert diff <= WEIGHT_ATOL, (r["case"], name, diff)
        if "muon" in kind and "torch" not in kind:  # the AdamW group is laid out flat
            assert per_case[0]["flat"] == [1], per_case[0]["case"]
        stepped = [r["stepped"] for r in per_case]
        trainable = per_case[0]["trainable"]
        # each rank steps its own whole parameters: all of them together once (stage 0: every rank all)
        assert sum(stepped) == (trainable * world if stage == 0 else trainable), (per_case[0]["case"], stepped)


# --------------------------------------------------------------------------- layout
def test_whole_params_layout_puts_each_parameter_whole_in_one_shard_balanced() -> None:
    entries = [(f"p{i}", (n,), torch.float32) for i, n in enumerate((100, 7, 300, 64, 64, 5, 250))]
    layout = FlatLayout.build(entries, world_size=3, bucket_numel=10_000, whole_params=True)
    assert len(layout.buckets) == 1
    owners = [layout.owner(i) for i in range(len(entries))]
    assert None not in owners
    loads = [sum(s.numel for s, o in zip(layout.params, owners, strict=True) if o == r) for r in range(3)]
    assert loads == [300, 250, 100 + 64 + 64 + 7 + 5]  # largest first, each to the least loaded rank
    bucket = layout.buckets[0]
    assert bucket.shard % 16 == 0 and bucket.shard >= max(loads) and bucket.padded == 3 * bucket.shard
    covered = sorted((s.offset - bucket.start, s.end - bucket.start) for s in layout.params)
    gaps = layout.gaps(0)
    assert sum(hi - lo for lo, hi in gaps) + sum(s.numel for s in layout.params) == bucket.padded
    assert all(not (lo < z and a < hi) for lo, hi in gaps for a, z in covered)  # gaps hold no parameter
    assert FlatLayout.from_dict(layout.to_dict()).params == layout.params
    assert layout.imbalance() == pytest.approx(bucket.padded / sum(loads))
    # the default layout cuts parameters across shards, and its only gap is the tail
    flat = FlatLayout.build(entries, world_size=3, bucket_numel=10_000)
    assert None in [flat.owner(i) for i in range(len(entries))]
    assert flat.gaps(0) == [(flat.buckets[0].numel, flat.buckets[0].padded)]


# --------------------------------------------------------------------------- parity
_TWO_RANKS = [
    (0, "muon", 4096, False),
    (1, "muon", 4096, False),
    (2, "muon", 600, False),
    (3, "muon", 4096, False),
    (1, "adafactor", 600, False),
    (2, "adafactor", 4096, False),
    (3, "adafactor", 4096, False),
    (2, "muon_config", 4096, False),
    (3, "torch_muon", 4096, False),
    (3, "muon", 4096, True),
    (3, "adafactor", 4096, True),
    (2, "muon+offload", 4096, False),
    (3, "adafactor+offload", 4096, False),
]


def test_per_tensor_optimizers_match_one_process_on_two_ranks() -> None:
    _check(run_distributed(_parity, world_size=2, args=(_TWO_RANKS,), timeout=300), 2)


def test_per_tensor_optimizers_match_one_process_on_four_ranks() -> None:
    cases = [(1, "muon", 4096, False), (2, "adafactor", 4096, False), (3, "muon", 4096, True)]
    _check(run_distributed(_parity, world_size=4, args=(cases,), timeout=300), 4)


# --------------------------------------------------------------------------- checkpoints
def _save(rank: int, world: int, root: str, stage: int, kind: str) -> list[float]:
    data = _data(2)
    engine = _engine(stage, kind, 600)
    _train(engine, data[:2])
    engine.save_checkpoint(root, tag="t")
    losses = _train(engine, data[2:4])
    engine.destroy()
    return losses


def _resume(rank: int, world: int, root: str, stage: int, kind: str) -> list[float]:
    data = _data(2)
    engine = _engine(stage, kind, 4096)
    engine.load_checkpoint(root, tag="t")
    # the global batches of the saving run: 2 ranks x MICRO rows per micro-step, re-cut for this world size
    losses = []
    import torch.distributed as dist

    for batch in data[2:4]:
        total = torch.zeros(())
        rows = batch[0].shape[0] // (GAS * world)
        for m in range(GAS):
            start = (m * world + engine.dp_rank) * rows
            loss = engine(*(t[start : start + rows] for t in batch))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (GAS * world))
    engine.destroy()
    return losses


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_per_tensor_state_checkpoints_reshard_between_world_sizes_and_stages(tmp_path: Path, kind: str) -> None:
    through = run_distributed(_save, world_size=2, args=(str(tmp_path / "a"), 2, kind))[0]
    resumed = run_distributed(_resume, world_size=4, args=(str(tmp_path / "a"), 3, kind))[0]
    assert resumed == pytest.approx(through, rel=LOSS_RTOL)


# --------------------------------------------------------------------------- state access, refusals, mismatches
def _state_access(rank: int, world: int, stage: int) -> dict[str, Any]:
    from ds_strategy.utils import safe_get_full_optimizer_state, safe_get_local_optimizer_state

    engine = _engine(stage, "muon", 4096)
    _train(engine, _data(world)[:2])
    out = {}
    matrices = {n for n, p in _model().named_parameters() if p.ndim == 2 and "emb" not in n}
    for name, p in engine.module.named_parameters():
        key = "momentum_buffer" if name in matrices else "exp_avg"
        out[name] = (key, safe_get_full_optimizer_state(p, key), safe_get_local_optimizer_state(p, key).numel())
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_full_optimizer_state_of_a_per_tensor_optimizer_is_the_one_process_state(stage: int) -> None:
    from ds_strategy import MuonWithAuxAdam

    results = run_distributed(_state_access, world_size=2, args=(stage,))
    model = _model()
    opt = MuonWithAuxAdam(_muon_groups(model), lr=0.02, adam_lr=3e-3, weight_decay=0.01)
    for batch in _data(2)[:2]:
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        key, full, _ = results[0][name]
        assert torch.allclose(full, opt.state[p][key], atol=WEIGHT_ATOL), name
        assert torch.equal(full, results[1][name][1])
        local = sorted(r[name][2] for r in results)
        if key == "momentum_buffer":  # a Muon matrix lives whole on one rank: all its state there, none elsewhere
            assert local == [0, p.numel()], name
        else:  # the AdamW group is flat: its parameters' state split between the ranks
            assert sum(local) == p.numel(), name


def _refusal(rank: int, world: int, what: str) -> str:
    import ds_strategy

    model = _model()
    cfg = _config(2, "muon", 4096)
    optimizer: Any = _optimizer("muon", model)
    if what == "ratio":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.5}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if what == "factory":
        optimizer = lambda groups: torch.optim.Adafactor(groups, lr=1e-2)  # noqa: E731
    if what == "force_cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(ValueError) as info:
        ds_strategy.initialize(model=model, optimizer=optimizer, config=cfg)
    return str(info.value)


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("ratio", "offload_optimizer.ratio 0.5"),
        ("factory", "Pass the optimizer itself"),
        ("force_cpu", "zero_force_ds_cpu_optimizer"),
    ],
)
def test_what_a_per_tensor_optimizer_cannot_run_under_is_refused_by_name(what: str, says: str) -> None:
    assert says in run_distributed(_refusal, world_size=2, args=(what,))[0]


def _mismatch(rank: int, world: int, root: str) -> str:
    import ds_strategy
    from ds_strategy.runtime.checkpoint.format import CheckpointError

    engine = _engine(2, "muon", 4096)
    _train(engine, _data(world)[:1])
    engine.save_checkpoint(root, tag="t")
    engine.destroy()
    model = _model()
    cfg = {**_config(2, "muon", 4096), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    groups = [{"params": g["params"]} for g in _muon_groups(model)]  # the same two groups, AdamW's
    engine, _, _, _ = ds_strategy.initialize(model=model, model_parameters=groups, config=cfg)
    with pytest.raises(CheckpointError) as info:
        engine.load_checkpoint(root, tag="t")
    engine.load_checkpoint(root, tag="t", load_optimizer_states=False)  # the weights still load
    engine.destroy()
    return str(info.value)


def test_per_tensor_state_does_not_load_into_an_element_wise_optimizer(tmp_path: Path) -> None:
    message = run_distributed(_mismatch, world_size=2, args=(str(tmp_path),))[0]
    assert "per-tensor optimizer's state" in message and "load_optimizer_states=False" in message


def _padding_log(rank: int, world: int, units: str) -> list[str]:
    import logging

    import ds_strategy
    from tests.runtime.common import runtime_log_messages

    model = _model()
    cfg = _config(3, "adafactor", 4096)
    cfg["zero_optimization"]["stage3_fetch_units"] = units
    with runtime_log_messages(logging.INFO) as messages:
        engine, *_ = ds_strategy.initialize(model=model, optimizer=_optimizer("adafactor", model), config=cfg)
    engine.destroy()
    return [m for m in messages if "per-tensor optimizer" in m]


def test_large_padding_of_the_whole_parameter_layout_is_warned_about() -> None:
    modules = run_distributed(_padding_log, world_size=2, args=("modules",))
    assert any("is padded to" in m and 'stage3_fetch_units "blocks"' in m for m in modules[0]), modules[0]
    assert modules[1] == []  # rank 0 speaks
    blocks = run_distributed(_padding_log, world_size=2, args=("blocks",))
    assert not any("is padded to" in m for m in blocks[0]) and any("laid out whole" in m for m in blocks[0])


def test_muon_split_gives_embeddings_norms_and_a_hugging_face_head_to_adamw() -> None:
    from ds_strategy.runtime.muon import embedding_ids, split_for_muon
    from tests.sequence.common import tiny_causal_lm

    model = tiny_causal_lm("Llama", "sdpa")  # an untied lm_head: a 2-D matrix named by get_output_embeddings()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = split_for_muon([{"params": list(model.parameters()), "lr": 0.02}], embedding_ids(model))
    muon = {names[id(p)] for g in groups if g["use_muon"] for p in g["params"]}
    adam = {names[id(p)] for g in groups if not g["use_muon"] for p in g["params"]}
    assert "lm_head.weight" in adam and "model.embed_tokens.weight" in adam and "model.norm.weight" in adam
    assert muon and all(n.endswith("_proj.weight") for n in muon), muon
    assert all(g["lr"] == 0.02 for g in groups)  # the group's hyperparameters travel with both parts
    model.model.layers[0].mlp.up_proj.weight.use_muon = False  # a parameter's own say wins
    again = split_for_muon([{"params": list(model.parameters())}], embedding_ids(model))
    assert "model.layers.0.mlp.up_proj.weight" in {
        names[id(p)] for g in again if not g["use_muon"] for p in g["params"]
    }


def test_muon_split_finds_the_head_of_a_wrapped_hugging_face_model() -> None:
    """A LightningModule (or any wrapper) holding the HF model: its lm_head is still AdamW's."""
    from ds_strategy.runtime.muon import embedding_ids, split_for_muon
    from tests.sequence.common import tiny_causal_lm

    wrapper = torch.nn.Module()
    wrapper.model = tiny_causal_lm("Llama", "sdpa")
    names = {id(p): n for n, p in wrapper.named_parameters()}
    groups = split_for_muon([{"params": list(wrapper.parameters())}], embedding_ids(wrapper))
    adam = {names[id(p)] for g in groups if not g["use_muon"] for p in g["params"]}
    assert "model.lm_head.weight" in adam, adam
