"""NVMe offload (ZeRO-Infinity) is CPU offload whose bytes rest in swap files: on 2 ranks, every stage and
precision trains bit for bit like the same run with CPU offload (the arithmetic is the same; only where the
masters, optimizer state, gradients and partitions wait between uses differs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_strategy.runtime.zero.init import init_shard
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
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": path,
            "buffer_count": 2,
            "buffer_size": 400,
            "max_in_cpu": 0,
        }
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
            if device == "nvme" and stage == 3:  # zero.Init keeps its shards in swap files too (config's nvme)
                from ds_strategy.zero import Init

                with Init(config_dict_or_path=cfg):
                    model = make_model()
                info = init_shard(model.fc1.weight)
                assert info is not None and info.store is not None and info.shard.numel() == 0
            else:
                model = make_model()
            engine, _, _, _ = rt.initialize(model=model, model_parameters=_groups(model), config=cfg)
            if device == "nvme" and stage == 3:  # the engine took every shard: zero.Init's file is gone
                mine = [d for d in (Path(path) / "ds_strategy_swap").iterdir() if f"-rank{rank}-" in d.name]
                assert len(mine) == 2, mine  # the engine's optimizer and parameter directories
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


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """groups_of's split (matrices with weight decay) by true shape: zero.Init leaves 0-element placeholders."""
    ndim = {id(p): len(info.shape) if (info := init_shard(p)) is not None else p.ndim for p in model.parameters()}
    decay = [p for p in model.parameters() if ndim[id(p)] == 2]
    rest = [p for p in model.parameters() if ndim[id(p)] != 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _check_at_rest(engine: Any, stage: int) -> None:
    """Between steps nothing swapped is in memory: masters, optimizer state and (stage 3) gradients and
    partitions are placeholders, and the files are owner-only."""
    masters = [m for gs in engine.stage.groups for m in gs.masters]
    assert len(engine.stage.stepper.tiles()) > 1
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
        assert all(gs.rest.swapped for gs in engine.stage.sharded)  # (the frozen storage here is one persistent bucket)
        assert all(gs.part.numel() == 0 for gs in engine.stage.storages if gs.rest.swapped)


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
    combos = [{"stage": stage, "precision": p, "clip": 0.3 if p != "fp16" else 0.0} for p in ("fp32", "bf16", "fp16")]
    ranks = run_distributed(_grid, world_size=WORLD, args=(str(tmp_path), combos), timeout=300)
    for results in ranks:
        for result in results:
            _assert_same(result)
    assert not list((tmp_path / "ds_strategy_swap").iterdir())


# ---------------------------------------------------------------------------------------------- checkpoints
def _engine(kind: str, stage: int, precision: str, path: str) -> Any:
    import ds_strategy.runtime as rt

    cfg = config(stage=stage, precision=precision, offload=kind != "plain", micro=MICRO, gas=GAS, clip=0.3)
    cfg["zero_optimization"]["sub_group_size"] = 300
    if kind == "nvme":
        cfg = nvme_config(cfg, path, stage=stage)
    model = make_model()
    engine, _, _, _ = rt.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    return engine


def _checkpoint_round_trip(rank: int, world: int, path: str, stage: int, precision: str) -> list[Any]:
    """Train NVMe 3 steps, save; a CPU-offload engine and a fresh NVMe engine load it; all three go on for
    2 steps and must agree bit for bit. Then the CPU-offload engine saves and a new NVMe engine loads that."""
    data = batches(5, MICRO * GAS * world)
    first = _engine("nvme", stage, precision, path)
    engine_run(first, data[:3], micro=MICRO, gas=GAS)
    first.save_checkpoint(f"{path}/ckpt", tag="a")
    resumed = {}
    for kind in ("cpu", "nvme"):
        other = _engine(kind, stage, precision, path)
        other.load_checkpoint(f"{path}/ckpt", tag="a")
        resumed[kind] = other
    traces = {"first": engine_run(first, data[3:], micro=MICRO, gas=GAS)}
    traces.update({kind: engine_run(e, data[3:], micro=MICRO, gas=GAS) for kind, e in resumed.items()})
    resumed["cpu"].save_checkpoint(f"{path}/ckpt", tag="b")
    again = _engine("nvme", stage, precision, path)
    again.load_checkpoint(f"{path}/ckpt", tag="b")
    with again.stage.resident(), resumed["cpu"].stage.resident():
        from tests.runtime.common import full_masters

        mine, theirs = full_masters(again), full_masters(resumed["cpu"])
        same = mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for e in (first, again, *resumed.values()):
        e.destroy()
    return [traces, same]


def _resharded(rank: int, world: int, path: str, stage: int) -> dict[str, torch.Tensor]:
    """Load a 2-rank NVMe checkpoint on ``world`` ranks into a plain engine: the fp32 masters it holds."""
    from tests.runtime.common import full_masters

    engine = _engine("nvme" if world == 1 else "plain", stage, "fp32", path)
    engine.load_checkpoint(f"{path}/ckpt", tag="a")
    with engine.stage.resident():
        out = full_masters(engine)
    engine.destroy()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage,precision", [(3, "bf16"), (2, "fp32")])
def test_nvme_checkpoints_load_into_cpu_offload_and_back(stage: int, precision: str, tmp_path: Path) -> None:
    from ds_strategy.runtime.checkpoint.consolidate import consolidate_fp32_state_dict

    ranks = run_distributed(
        _checkpoint_round_trip, world_size=WORLD, args=(str(tmp_path), stage, precision), timeout=300
    )
    for traces, same in ranks:
        first = traces["first"]
        for kind in ("cpu", "nvme"):
            assert traces[kind].losses == first.losses, kind
            for name, value in first.params.items():
                assert torch.equal(traces[kind].params[name], value), f"{kind} {name}"
        assert same, "an NVMe engine loading a CPU-offload checkpoint holds other masters"
    if precision == "fp32":  # resharding: 2 ranks -> 1 rank (NVMe engine)
        saved = consolidate_fp32_state_dict(tmp_path / "ckpt", "a")
        (one,) = run_distributed(_resharded, world_size=1, args=(str(tmp_path), stage), timeout=300)
        for name, value in one.items():
            assert torch.equal(value, saved[name]), name


def _missing_path(rank: int, world: int, path: str) -> str:
    from ds_strategy.runtime.swap import NvmePathError

    try:
        _engine("nvme", 3, "fp32", path)
    except NvmePathError as err:
        return str(err)
    return "no error"


@pytest.mark.multiprocess
def test_missing_nvme_path_is_an_error_before_training(tmp_path: Path) -> None:
    (message,) = run_distributed(_missing_path, world_size=1, args=(str(tmp_path / "absent"),), timeout=120)
    assert "zero_optimization.offload_optimizer.nvme_path" in message and "does not exist" in message
