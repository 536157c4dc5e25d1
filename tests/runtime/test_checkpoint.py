"""Exact resume: N steps, save, a fresh engine loads and trains M more == N+M steps uninterrupted.

Bit-identical (``torch.equal``) for every stage 0-3, optimizer offload and fp16/bf16 on CPU: the fp32
masters, optimizer state, lr schedule, loss scale and counters all come back exactly, and the ranks'
data slices are the same, so there is no tolerance to state. Also: client state round trip, the
``latest`` file, the default tag, and every file loading with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import batches, config, engine_run, full_masters, groups_of, make_model

pytestmark = pytest.mark.multiprocess

MICRO, GAS = 2, 2
N, M = 3, 3

COMBOS = [
    {"stage": 0, "precision": "fp32", "offload": False},
    {"stage": 1, "precision": "fp32", "offload": False},
    {"stage": 2, "precision": "fp32", "offload": False},
    {"stage": 1, "precision": "fp32", "offload": True},
    {"stage": 2, "precision": "fp32", "offload": True},
    {"stage": 2, "precision": "bf16", "offload": False},
    {"stage": 1, "precision": "fp16", "offload": True},
    {"stage": 3, "precision": "fp32", "offload": False},
    {"stage": 3, "precision": "bf16", "offload": True},
]

SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {"warmup_num_steps": 2, "total_num_steps": 20, "warmup_max_lr": 0.01, "warmup_type": "linear"},
}


def make_engine(combo: dict[str, Any], *, seed: int = 0, **overrides: Any) -> Any:
    import ds_strategy.runtime as rt

    model = make_model(seed)
    cfg = config(
        stage=combo["stage"],
        precision=combo["precision"],
        offload=combo["offload"],
        micro=MICRO,
        gas=GAS,
        clip=0.5,
        scheduler=SCHEDULER,
        **overrides,
    )
    if combo["offload"]:
        cfg["zero_force_ds_cpu_optimizer"] = False
    engine, _, _, _ = rt.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    return engine


def optimizer_state(engine: Any) -> list[dict[str, torch.Tensor]]:
    assert engine.optimizer is not None
    return [
        {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in engine.optimizer.state[m].items()}
        for ms in engine.stage.masters
        for m in ms
    ]


def _resume(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    data = batches(N + M, MICRO * GAS * world)
    out = []
    for i, combo in enumerate(COMBOS):
        save_dir = Path(root) / f"combo{i}"
        whole = make_engine(combo)
        full = engine_run(whole, data, micro=MICRO, gas=GAS)
        whole_state = optimizer_state(whole)
        whole.destroy()

        first = make_engine(combo)
        engine_run(first, data[:N], micro=MICRO, gas=GAS)
        path = first.save_checkpoint(save_dir, client_state={"step": N, "note": "x", "t": torch.arange(3)})
        first.destroy()

        second = make_engine(combo, seed=7)  # other initial weights: everything must come from the checkpoint
        loaded, client = second.load_checkpoint(save_dir)
        counters = (second.global_steps, second.global_samples, second.micro_steps, second.skipped_steps)
        rest = engine_run(second, data[N:], micro=MICRO, gas=GAS)
        out.append(
            {
                "combo": combo,
                "path": path,
                "loaded": loaded,
                "client": client,
                "counters": counters,
                "full": full,
                "rest": rest,
                "same_state": all(
                    all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
                    for a, b in zip(whole_state, optimizer_state(second), strict=True)
                ),
                "loss_scale": (whole.loss_scale, second.loss_scale),
                "lr": (whole.get_lr(), second.get_lr()),
            }
        )
        second.destroy()
    return out


def test_exact_resume_every_stage(tmp_path: Path) -> None:
    results = run_distributed(_resume, world_size=2, args=(str(tmp_path),))
    for res in results[0]:
        label = str(res["combo"])
        assert res["path"].endswith(f"global_step{N}"), label
        assert res["loaded"] == res["path"], label
        assert res["client"]["step"] == N and res["client"]["note"] == "x", label
        assert torch.equal(res["client"]["t"], torch.arange(3)), label
        assert res["counters"] == (N, N * MICRO * GAS * 2, N * GAS, 0), label
        assert res["full"].losses[N:] == res["rest"].losses, label
        for name, value in res["full"].masters.items():
            assert torch.equal(value, res["rest"].masters[name]), f"{label}: master {name}"
        for name, value in res["full"].params.items():
            assert torch.equal(value, res["rest"].params[name]), f"{label}: param {name}"
        assert res["same_state"], f"{label}: optimizer state differs"
        assert res["loss_scale"][0] == res["loss_scale"][1], label
        assert res["lr"][0] == res["lr"][1], label
    # both ranks agree on what they returned
    assert [r["loaded"] for r in results[0]] == [r["loaded"] for r in results[1]]


def test_files_are_weights_only_and_latest(tmp_path: Path) -> None:
    root = tmp_path / "combo0"
    run_distributed(_save_twice, world_size=2, args=(str(root),))
    assert (root / "latest").read_text() == "second"
    assert sorted(p.name for p in root.iterdir()) == ["first", "latest", "second"]
    files = sorted((root / "first").iterdir())
    assert [f.name for f in files] == [
        "meta.pt",
        "model_states.pt",
        "zero_rank_00000_optim_states.pt",
        "zero_rank_00001_optim_states.pt",
    ]
    for f in files:
        torch.load(f, weights_only=True)  # raises on anything but tensors and plain values


def _save_twice(rank: int, world: int, root: str) -> None:
    engine = make_engine(COMBOS[2])
    engine_run(engine, batches(1, MICRO * GAS * world), micro=MICRO, gas=GAS)
    engine.save_checkpoint(root, tag="first")
    engine.save_checkpoint(root, tag="second", save_latest=True)
    engine.save_checkpoint(root, tag="first", save_latest=False)  # re-saving a tag replaces it whole
    engine.destroy()


def _partial_loads(rank: int, world: int, root: str) -> dict[str, Any]:
    data = batches(3, MICRO * GAS * world)
    first = make_engine(COMBOS[4])  # stage 2 + offload
    engine_run(first, data[:2], micro=MICRO, gas=GAS)
    first.save_checkpoint(root)
    saved = full_masters(first)
    first.destroy()
    out: dict[str, Any] = {}
    for flags in ({"load_module_only": True}, {"load_optimizer_states": False, "load_lr_scheduler_states": False}):
        engine = make_engine(COMBOS[1], seed=5)  # stage 1 without offload: another stage as well
        lr = engine.get_lr()
        _, client = engine.load_checkpoint(root, **flags)
        out[str(flags)] = {
            "weights": all(torch.equal(full_masters(engine)[n], saved[n]) for n in saved),
            "state": len(engine.optimizer.state),
            "steps": engine.global_steps,
            "lr_kept": engine.get_lr() == lr,
            "client": client,
        }
        engine_run(engine, data[2:], micro=MICRO, gas=GAS)  # and it trains on
        engine.destroy()
    return out


def test_module_only_and_weights_only_loads(tmp_path: Path) -> None:
    out = run_distributed(_partial_loads, world_size=2, args=(str(tmp_path),))[0]
    module_only = out[str({"load_module_only": True})]
    assert module_only == {"weights": True, "state": 0, "steps": 0, "lr_kept": True, "client": {}}
    no_optim = out[str({"load_optimizer_states": False, "load_lr_scheduler_states": False})]
    assert no_optim["weights"] and no_optim["state"] == 0 and no_optim["steps"] == 2 and no_optim["lr_kept"]


def _two_nodes(rank: int, world: int, roots: list[str]) -> None:
    engine = make_engine(COMBOS[1])
    engine_run(engine, batches(1, MICRO * GAS * world), micro=MICRO, gas=GAS)
    engine.save_checkpoint(roots[rank], tag="n")  # each "node" saves to its own disk (another path here)
    engine.destroy()


def test_nodes_with_local_disks(tmp_path: Path) -> None:
    """Two ranks as two nodes (LOCAL_RANK 0 each) saving to separate directories: rank 0's directory has the
    published tag, rank 1's its shard under the tag; copying that shard over completes the checkpoint."""
    from ds_strategy.runtime.checkpoint import CheckpointError, consolidate_fp32_state_dict

    roots = [tmp_path / "node0", tmp_path / "node1"]
    run_distributed(_two_nodes, world_size=2, args=([str(r) for r in roots],), env={"LOCAL_RANK": "0"})
    shard = "zero_rank_00001_optim_states.pt"
    assert sorted(p.name for p in (roots[1] / "n").iterdir()) == [shard]
    assert sorted(p.name for p in roots[0].iterdir()) == ["latest", "n"]  # no staging left on either node
    assert sorted(p.name for p in roots[1].iterdir()) == ["n"]
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        consolidate_fp32_state_dict(roots[0])
    (roots[0] / "n" / shard).write_bytes((roots[1] / "n" / shard).read_bytes())
    assert len(consolidate_fp32_state_dict(roots[0])) == len(make_model().state_dict())
