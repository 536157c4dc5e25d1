"""NVMe offload (ZeRO-Infinity) is CPU offload whose bytes rest in swap files: on 2 ranks, every stage and
precision trains bit for bit like the same run with CPU offload (the arithmetic is the same; only where the
masters, optimizer state, gradients and partitions wait between uses differs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import batches, config, engine_run, groups_of, make_model

STEPS, MICRO, GAS, WORLD = 5, 2, 2, 2


def nvme_config(cfg: dict[str, Any], path: str, *, stage: int, params: bool = True) -> dict[str, Any]:
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": path,
        "buffer_count": 3,
        "pipeline_read": True,
        "pipeline_write": True,
    }
    zero["sub_group_size"] = 300  # several tiles: the pipeline reads ahead and writes behind
    if stage == 3 and params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_count": 2, "buffer_size": 400, "max_in_cpu": 0}
    cfg["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}
    return cfg


def _grid(rank: int, world: int, path: str, combos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import ds_strategy.runtime as rt

    data = batches(STEPS, MICRO * GAS * world)
    out = []
    for combo in combos:
        traces = {}
        for device in ("cpu", "nvme"):
            stage, precision = combo["stage"], combo["precision"]
            cfg = config(stage=stage, precision=precision, offload=True, micro=MICRO, gas=GAS, clip=combo["clip"])
            cfg["zero_optimization"]["sub_group_size"] = 300
            if stage == 3:
                cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
                cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10
            if device == "nvme":
                cfg = nvme_config(cfg, path, stage=stage)
            model = make_model()
            engine, _, _, _ = rt.initialize(model=model, model_parameters=groups_of(model), config=cfg)
            traces[device] = engine_run(engine, data, micro=MICRO, gas=GAS)
            if device == "nvme":
                swapdirs = engine.stage.swap.directories
                assert all(Path(d).is_dir() for d in swapdirs)
                _check_at_rest(engine, stage)
            engine.destroy()
            if device == "nvme":
                assert not any(Path(d).exists() for d in swapdirs)
        out.append({**combo, **traces})
    return out


def _check_at_rest(engine: Any, stage: int) -> None:
    """Between steps nothing swapped is in memory: masters, optimizer state and (stage 3) gradients and
    partitions are placeholders, and the files are owner-only."""
    masters = [m for gs in engine.stage.groups for m in gs.masters]
    assert len(engine.stage._tile_lists()) > 1
    assert all(m.numel() == 0 for m in masters)
    for m in masters:
        assert all(t.numel() == 0 for t in engine.optimizer.state[m].values() if t.dim() >= 1)
    for d in engine.stage.swap.directories:
        assert Path(d).stat().st_mode & 0o777 == 0o700
        for f in Path(d).iterdir():
            assert f.stat().st_mode & 0o777 == 0o600
    if stage == 3:
        assert all(h.numel() == 0 for hs in engine.stage._grad_holders for h in hs)
        swapper = engine.stage.swap.params
        assert swapper.reads_ahead_used > 0, "the read-ahead never served a gather"
        assert all(gs.swapped for gs in engine.stage.sharded)  # (the frozen storage here is one persistent bucket)
        assert all(gs.part.numel() == 0 for gs in engine.stage.storages if gs.swapped)


def _assert_same(result: dict[str, Any]) -> None:
    cpu, nvme = result["cpu"], result["nvme"]
    label = f"stage {result['stage']} {result['precision']} clip={result['clip']}"
    assert cpu.losses == nvme.losses, label
    assert cpu.norms == nvme.norms, label
    for name, value in cpu.params.items():
        assert torch.equal(value, nvme.params[name]), f"{label}: weight {name}"
    for name, value in cpu.masters.items():
        assert torch.equal(value, nvme.masters[name]), f"{label}: master {name}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_is_bitwise_cpu_offload(stage: int, tmp_path: Path) -> None:
    combos = [
        {"stage": stage, "precision": p, "clip": 0.3 if p != "fp16" else 0.0} for p in ("fp32", "bf16", "fp16")
    ]
    ranks = run_distributed(_grid, world_size=WORLD, args=(str(tmp_path), combos), timeout=300)
    for results in ranks:
        for result in results:
            _assert_same(result)
    assert not list((tmp_path / "ds_strategy_swap").iterdir())
