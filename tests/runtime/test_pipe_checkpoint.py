"""Pipeline checkpoints: per-rank shards that load at another depth and data-parallel degree, into a plain
ZeroEngine, and through ``ds-zero-to-fp32``; training resumed from a checkpoint continues as without the
interruption (bit-exactly on the same grid).

Runs on 4 processes: save at pipe 2 x data 2 (ZeRO-1, and once at ZeRO-0), load at pipe 2 x data 2, at
pipe 4 and at pipe 1 x data 4, continue training, and compare with the uninterrupted run (same grid: equal
losses) and with the single-process reference (other grids: fp32 losses rtol 1e-5, weights atol 1e-6 - the
gradient average is summed in another order). The files are then damaged one way at a time: each error
names the file at fault.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, reference_run, specs

MICRO, GAS, LR = 2, 4, 1e-2


def _save_then_load(rank: int, world: int, root: str, root0: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import PipelineModule
    from ds_strategy.utils import safe_get_full_fp32_param

    batches = data(4, 1, GAS, MICRO)  # every data-parallel rank sees the same micro-batches: the reference is dp-free
    cfg = pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=0.05)
    out: dict[str, Any] = {}

    def pipeline(stages: int, config: dict[str, Any] = cfg) -> tuple[Any, Any]:
        module = PipelineModule(
            specs(), num_stages=stages, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform"
        )
        engine, _, _, _ = ds_strategy.initialize(model=module, config=config)
        return module, engine

    def train(engine: Any, steps: list[Any]) -> list[float]:
        return [float(engine.train_batch(iter(step[0]))) for step in steps]

    # ZeRO-0: every data-parallel rank holds every bucket whole, but saves only its ZeRO shard's pieces
    _, engine = pipeline(2, pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=0.05, stage=0))
    out["zero0"] = train(engine, batches[:2])
    engine.save_checkpoint(root0)
    engine.destroy()

    _, engine = pipeline(2)
    out["first"] = train(engine, batches[:2])
    engine.save_checkpoint(root, client_state={"note": "half"})
    out["uninterrupted"] = train(engine, batches[2:])
    engine.destroy()
    for stages in (2, 4, 1):
        module, engine = pipeline(stages)
        tag_dir, client = engine.load_checkpoint(root)
        assert client == {"note": "half"} and Path(tag_dir).name == "global_step2"
        assert engine.global_steps == 2
        out[f"resumed{stages}"] = train(engine, batches[2:])
        out[f"weights{stages}"] = {n: safe_get_full_fp32_param(p).clone() for n, p in module.named_parameters()}
        engine.destroy()
    # a checkpoint in the format before shards (whole values, one file per layer) still loads
    import torch.distributed as dist

    root1 = str(Path(root).parent / "format1")
    if rank == 0:
        _to_format1(Path(root), Path(root1))
    dist.barrier()
    module, engine = pipeline(4)
    engine.load_checkpoint(root1)
    out["format1"] = train(engine, batches[2:])
    engine.destroy()
    module, engine = pipeline(1)  # the ZeRO-0 checkpoint at ZeRO-1, pipe 1 x data 4
    engine.load_checkpoint(root0)
    out["from_zero0"] = {n: safe_get_full_fp32_param(p).clone() for n, p in module.named_parameters()}
    # ranks passing different tags: checkpoint.tag_validation "Warn" (the default) saves under rank 0's
    engine.save_checkpoint(root0, tag=f"t{rank}", save_latest=False)
    engine.destroy()
    # a plain ZeroEngine over a one-stage model takes the consolidated weights
    from ds_strategy.runtime.checkpoint.pipe_files import pipe_state_dict

    plain = PipelineModule(specs(), num_stages=1, loss_fn=nn.MSELoss(), partition_method="uniform")
    zero = ds_strategy.ZeroEngine(plain, ds_strategy.config.load_config(cfg, world_size=world))
    zero.load_full_state_dict(pipe_state_dict(root))
    out["plain"] = {n: p.detach().clone() for n, p in plain.named_parameters()}
    return out


def _to_format1(root: Path, target: Path) -> None:
    """Rewrite a checkpoint in format 1: per entry ``<entry>-model_states.pt`` holding {"module": whole fp32
    values and buffers, "optimizer": {name: {key: whole state}}, "prefix"}, and a pipe_meta.pt without files."""
    from ds_strategy.runtime.checkpoint.pipe_files import PipeCheckpoint, resolve_pipe

    source = PipeCheckpoint(resolve_pipe(root, None))
    tag_dir = target / "global_step2"
    tag_dir.mkdir(parents=True)
    for key in source.entries():
        trainable = {name: source.full(key, name) for name in source.params(key)}
        states = {
            name: {k: source.full(key, name, k) for k in source.state_keys(key, name)} for name in source.params(key)
        }
        module = {**trainable, **source.module_entries(key)}
        torch.save(
            {"module": module, "optimizer": states, "prefix": source.prefix(key)}, tag_dir / f"{key}-model_states.pt"
        )
    old_keys = ("num_layers", "num_stages", "parts", "tied", "counters", "scheduler", "loss_scaler")
    meta = {k: source.meta[k] for k in (*old_keys, "optimizer_scalars", "client_state")}
    meta["format"] = "ds_strategy-pipe-1"
    torch.save(meta, tag_dir / "pipe_meta.pt")
    (target / "latest").write_text("global_step2")


def _pieces(tag_dir: Path) -> dict[str, int]:
    """Elements saved per parameter over every rank file (fp32 pieces)."""
    count: dict[str, int] = {}
    for f in sorted(tag_dir.glob("pipe_rank_*_states.pt")):
        saved = torch.load(f, weights_only=True)
        for entry in saved["entries"].values():
            for name, piece in entry["params"].items():
                key = entry["prefix"] + name
                count[key] = count.get(key, 0) + piece["fp32"].numel()
                assert all(v.numel() == piece["fp32"].numel() for v in piece["state"].values())
    return count


def test_checkpoint_loads_at_other_depths_and_data_parallel_degrees(tmp_path: Path) -> None:
    root, root0 = tmp_path / "zero1", tmp_path / "zero0"
    results = run_distributed(_save_then_load, world_size=4, args=(str(root), str(root0)), timeout=300)
    ref_losses, ref_weights = reference_run(data(4, 1, GAS, MICRO), lr=LR, clip=0.05)
    _, half_weights = reference_run(data(2, 1, GAS, MICRO), lr=LR, clip=0.05)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["first"]), torch.tensor(ref_losses[:2]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["zero0"]), torch.tensor(ref_losses[:2]), rtol=1e-5, atol=0)
        assert r["resumed2"] == r["uninterrupted"], (r["resumed2"], r["uninterrupted"])  # same grid: bit-exact
        assert r["format1"] == r["resumed4"], (r["format1"], r["resumed4"])  # the same values, loaded from format 1
        for stages in (2, 4, 1):
            torch.testing.assert_close(
                torch.tensor(r[f"resumed{stages}"]), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0
            )
            for name, value in r[f"weights{stages}"].items():
                torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-6, msg=name)
        for name, value in r["plain"].items():
            torch.testing.assert_close(value, half_weights[name], rtol=0, atol=1e-6, msg=name)
        assert set(r["from_zero0"]) == set(half_weights)
        for name, value in r["from_zero0"].items():
            torch.testing.assert_close(value, half_weights[name], rtol=0, atol=1e-6, msg=name)
    for tag_dir in (root / "global_step2", root0 / "global_step2"):
        files = sorted(p.name for p in tag_dir.iterdir())
        assert files == ["pipe_meta.pt", *(f"pipe_rank_{r:05d}_states.pt" for r in range(4))], files
        # shards: every element of every trainable parameter saved exactly once over all files (ZeRO-0 too)
        assert _pieces(tag_dir) == {n: v.numel() for n, v in half_weights.items()}, tag_dir
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest"]  # nothing staged is left
    # ds-zero-to-fp32 writes the same one-stage state dict
    from ds_strategy.runtime.checkpoint.consolidate import consolidate_fp32_state_dict, main

    assert main([str(root), str(tmp_path / "model.pt")]) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(half_weights)
    for name, value in state.items():
        torch.testing.assert_close(value, half_weights[name], rtol=0, atol=1e-6, msg=name)
    assert (root0 / "latest").read_text() == "global_step2"  # save_latest=False
    assert sorted(p.name for p in root0.iterdir()) == ["global_step2", "latest", "t0"]
    zero0 = consolidate_fp32_state_dict(root0)
    for name, value in zero0.items():
        torch.testing.assert_close(value, half_weights[name], rtol=0, atol=1e-6, msg=name)
    _damaged(root, root0, tmp_path)


def _damaged(root: Path, root0: Path, tmp_path: Path) -> None:
    """Each damage is refused with a CheckpointError naming the file (read by pipe_state_dict, as a load reads)."""
    from ds_strategy.runtime.checkpoint.format import CheckpointError
    from ds_strategy.runtime.checkpoint.pipe_files import pipe_state_dict

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(root, target)
        return target / "global_step2"

    shard = "pipe_rank_00001_states.pt"
    tag_dir = copy("truncated")
    data = (tag_dir / shard).read_bytes()
    (tag_dir / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard} has {len(data) // 2} bytes, pipe_meta.pt recorded"):
        pipe_state_dict(tag_dir.parent)
    tag_dir = copy("missing")
    (tag_dir / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        pipe_state_dict(tag_dir.parent)
    tag_dir = copy("mixed")  # the same tag and grid, another save: the file sizes may agree, the save id does not
    shutil.copy(root0 / "global_step2" / shard, tag_dir / shard)
    meta = torch.load(tag_dir / "pipe_meta.pt", weights_only=True)
    meta["files"][shard] = (tag_dir / shard).stat().st_size
    torch.save(meta, tag_dir / "pipe_meta.pt")
    with pytest.raises(CheckpointError, match=f"{shard} was not written by the save that wrote"):
        pipe_state_dict(tag_dir.parent)
    tag_dir = copy("unsafe")  # a file that would run code when unpickled is refused (weights_only=True)
    meta = torch.load(tag_dir / "pipe_meta.pt", weights_only=True)
    meta["client_state"] = {"payload": _Payload()}
    torch.save(meta, tag_dir / "pipe_meta.pt")
    with pytest.raises(CheckpointError, match=r"pipe_meta\.pt cannot be read"):
        pipe_state_dict(tag_dir.parent)
    assert not _Payload.ran


class _Payload:
    ran = False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Payload._run, ())

    @staticmethod
    def _run() -> None:
        _Payload.ran = True


class FrozenScaled(nn.Linear):
    """A layer whose weight is frozen and which keeps a buffer the forward updates (a running count)."""

    def __init__(self, width: int) -> None:
        super().__init__(width, width)
        self.weight.requires_grad_(False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x)


def _frozen(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import LayerSpec, PipelineModule

    layers = [*specs()[:2], LayerSpec(FrozenScaled, 16), *specs()[2:]]
    cfg = pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=0.05)
    batches = data(3, 1, GAS, MICRO)
    out: dict[str, Any] = {}
    for stages, steps in ((2, batches[:2]), (1, batches[2:])):
        torch.manual_seed(stages)  # the frozen weight differs unless the checkpoint restores it
        module = PipelineModule(layers, num_stages=stages, loss_fn=nn.MSELoss(), partition_method="uniform")
        engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
        if stages == 1:
            engine.load_checkpoint(root)
            out["loaded"] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k.startswith("2.")}
        out[f"losses{stages}"] = [float(engine.train_batch(iter(step[0]))) for step in steps]
        if stages == 2:
            engine.save_checkpoint(root)
            out["saved"] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k.startswith("2.")}
        engine.destroy()
    return out


def test_frozen_parameters_and_buffers_round_trip(tmp_path: Path) -> None:
    """Saved whole by the owning stage, loaded at another grid (pipe 2 -> pipe 1 x data 2) as they were."""
    from ds_strategy.runtime.checkpoint.pipe_files import pipe_state_dict

    results = run_distributed(_frozen, world_size=2, args=(str(tmp_path),), timeout=180)
    saved = next(r["saved"] for r in results if r["saved"])  # the stage holding layer 2
    assert set(saved) == {"2.weight", "2.bias", "2.calls"} and float(saved["2.calls"]) == 2 * GAS
    for r in results:
        assert set(r["loaded"]) == set(saved)
        for k, v in saved.items():
            assert torch.equal(r["loaded"][k], v), k
    state = pipe_state_dict(tmp_path)
    for k, v in saved.items():
        assert torch.equal(state[k], v.float()), k
