"""Partial optimizer offload (``offload_optimizer.ratio``, ZeRO-Offload++'s Twin-Flow): runtime/zero/partial_offload.py.

Parity: on 2 ranks, every stage 1-3 in fp32 and bf16 (and fp16 at stage 2) trains at ratio 0.3, 0.7 and 1.0
bit-identically (``torch.equal``: losses, every rank's fp32 masters and the model's weights) to a full
offload with no ratio: on CPU both halves are stepped by the same kernels, and each element's update does
not depend on which side or tile steps it. Every run has one step with an infinite loss (skipped: the
loss scaler's skip at fp16, the device-side skip at bf16/fp32) and gradient clipping engaged at bf16/fp16.

Checkpoints: saved at ratio 0.3, loaded at 1.0 and at 0.7, training continues exactly as the uninterrupted
run at 0.3 (stages 2 and 3); loaded on 1 rank at 0.7, the masters and Adam's state are the saved ones.

The device-strict mode (compute device ``cpu:0``, host ``cpu``) moves the device part for real, as on a GPU:
the host masters, their optimizer state and gradient copies are host tensors, the device part device
tensors, and training is still bit-identical to the full offload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import batches, micro_slice

MICRO, GAS, STEPS, INF_STEP = 2, 2, 5, 2
BUCKET = 256  # each 16 x 16 matrix a bucket of its own: a group of several masters to split
RATIOS = (0.3, 0.7, 1.0)


class Stack(nn.Module):
    """Residual blocks of Linear + LayerNorm and a head: many equal buckets (stages 1-2) or fetch units (stage 3)."""

    def __init__(self, d: int = 16, depth: int = 6, d_out: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)) for _ in range(depth))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + F.gelu(block(x))
        return F.mse_loss(self.head(x).float(), y.float())


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _config(stage: int, precision: str, ratio: float | None) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": "cpu"}
    if ratio is not None:
        offload["ratio"] = ratio
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0 if precision == "fp32" else 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "offload_optimizer": offload,
        },
    }
    if stage == 3:  # every parameter partitioned (none persistent): one bucket per block, several to split
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "auto_cast": True}
    return cfg


def _engine(stage: int, precision: str, ratio: float | None) -> Any:
    import ds_strategy.runtime as rt

    torch.manual_seed(0)
    model = Stack()
    engine, _, _, _ = rt.initialize(
        model=model, model_parameters=_groups(model), config=_config(stage, precision, ratio)
    )
    return engine


def _local_masters(engine: Any) -> list[torch.Tensor]:
    return [torch.cat([m.detach().float().cpu().reshape(-1) for m in gs.masters]) for gs in engine.stage.groups]


def _train(engine: Any, data: list[Any], *, inf_step: int | None = INF_STEP) -> dict[str, Any]:
    """This rank's losses, norms (at each optimizer step) and, at the end, its masters and the whole weights."""
    from ds_strategy.zero import GatheredParameters

    losses, norms = [], []
    for step, batch in enumerate(data):
        for m in range(GAS):
            loss = engine(*micro_slice(batch, MICRO, engine.dp_world_size, m, engine.dp_rank))
            engine.backward(loss * float("inf") if step == inf_step and m == GAS - 1 else loss)
            engine.step()
            losses.append(loss.detach().float().clone())
        norms.append(float(engine.get_global_grad_norm()))
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {
        "losses": torch.stack(losses),
        "norms": norms,
        "masters": _local_masters(engine),
        "params": params,
        "skipped": engine.skipped_steps,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["losses"], b["losses"])
        and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
        and all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])
    )


def _placement(engine: Any) -> dict[str, Any]:
    split = engine.stage.master_split
    shares = [split.share(g, gs) if split is not None else 1.0 for g, gs in enumerate(engine.stage.groups)]
    breakdown = engine.memory_breakdown()
    placed = engine.memory_breakdown(by_device=True)
    host_state = 0
    on_host = split.host if split is not None else {m for gs in engine.stage.groups for m in gs.masters}
    for m in on_host:
        host_state += sum(t.numel() * t.element_size() for t in engine.optimizer.state[m].values())
    return {
        "shares": shares,
        "counts": [len(gs.masters) for gs in engine.stage.groups],
        "total": sum(breakdown.values()),
        "placed": placed,
        "host_state": host_state,
        "state": breakdown["optimizer_state"],
        "numel": sum(m.numel() for gs in engine.stage.groups for m in gs.masters),
    }


def _parity(rank: int, world: int) -> list[dict[str, Any]]:
    """Every (stage, precision): the full offload's run, then each ratio's, compared on this rank."""
    data = batches(STEPS, MICRO * GAS * world)
    out = []
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16") + (("fp16",) if stage == 2 else ()):
            engine = _engine(stage, precision, None)
            base = _train(engine, data)
            engine.destroy()
            for ratio in RATIOS:
                engine = _engine(stage, precision, ratio)
                run = _train(engine, data)
                out.append(
                    {
                        "label": f"stage {stage} {precision} ratio {ratio}",
                        "same": _same(run, base),
                        "skipped": (run["skipped"], base["skipped"]),
                        "clipped": precision == "fp32" or max(base["norms"]) > 0.05,
                        **_placement(engine),
                    }
                )
                engine.destroy()
    return out


def _checkpoint(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save at 0.3 after 3 steps; load at 1.0 and 0.7: the next steps equal the uninterrupted run's."""
    from ds_strategy.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    data = batches(6, MICRO * GAS * world)
    out: dict[str, Any] = {}
    for stage in (2, 3):
        engine = _engine(stage, "bf16", 0.3)
        _train(engine, data[:3], inf_step=None)
        engine.save_checkpoint(f"{root}/stage{stage}", tag="t")
        if stage == 2:  # what a 1-rank load must find
            params = [p for p in engine.module.parameters() if p.requires_grad]
            out["full"] = {
                "fp32": [safe_get_full_fp32_param(p) for p in params],
                "exp_avg": [safe_get_full_optimizer_state(p, "exp_avg") for p in params],
                "exp_avg_sq": [safe_get_full_optimizer_state(p, "exp_avg_sq") for p in params],
            }
        through = _train(engine, data[3:], inf_step=None)
        engine.destroy()
        for ratio in (1.0, 0.7):
            engine = _engine(stage, "bf16", ratio)
            engine.load_checkpoint(f"{root}/stage{stage}", tag="t")
            resumed = _train(engine, data[3:], inf_step=None)
            out[f"stage {stage} -> {ratio}"] = _same(resumed, through)
            engine.destroy()
    return out


def _one_rank_load(rank: int, world: int, root: str) -> dict[str, Any]:
    from ds_strategy.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine = _engine(2, "bf16", 0.7)
    engine.load_checkpoint(f"{root}/stage2", tag="t")
    params = [p for p in engine.module.parameters() if p.requires_grad]
    full = {
        "fp32": [safe_get_full_fp32_param(p) for p in params],
        "exp_avg": [safe_get_full_optimizer_state(p, "exp_avg") for p in params],
        "exp_avg_sq": [safe_get_full_optimizer_state(p, "exp_avg_sq") for p in params],
    }
    _train(engine, batches(2, MICRO * GAS), inf_step=None)  # and it trains on
    engine.destroy()
    return full


@pytest.mark.multiprocess
def test_ratios_match_the_full_offload_and_checkpoints_cross_ratios(tmp_path: Path) -> None:
    results = run_distributed(_parity, world_size=2, timeout=300)
    for rank_results in results:
        for r in rank_results:
            assert r["same"], r["label"]
            assert r["skipped"] == (1, 1), r
            assert r["clipped"], r["label"]
            ratio = float(r["label"].split()[-1])
            assert all(s >= ratio for s in r["shares"]), r  # the host keeps at least the ratio
            if ratio < 1:  # the first group (matrices) is split: both sides stepped
                assert 0 < r["shares"][0] < 1, r
            placed = r["placed"]
            assert sum(placed.values()) == r["total"], r
            assert placed["optimizer_state_host"] == r["host_state"], r
            assert placed["optimizer_state"] + placed["optimizer_state_host"] == r["state"], r
    ckpt = run_distributed(_checkpoint, world_size=2, args=(str(tmp_path),), timeout=300)
    for rank_results in ckpt:
        for key, same in rank_results.items():
            if key != "full":
                assert same, key
    loaded = run_distributed(_one_rank_load, world_size=1, args=(str(tmp_path),), timeout=120)[0]
    saved = ckpt[0]["full"]
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        for a, b in zip(loaded[kind], saved[kind], strict=True):
            assert torch.equal(a, b), kind


def _strict(rank: int, world: int) -> dict[str, Any]:
    """Under the device-strict mode: where the split puts masters, state and gradient copies, and parity."""
    from ds_strategy.accelerator import get_accelerator
    from ds_strategy.utils import safe_get_full_optimizer_state

    def full_state(engine: Any) -> list[torch.Tensor]:  # full-state access reads both sides (a collective)
        return [safe_get_full_optimizer_state(p, "exp_avg_sq") for p in engine.module.parameters()]

    device = get_accelerator().device()
    data = batches(STEPS, MICRO * GAS * world)
    out: dict[str, Any] = {"device": str(device)}
    for stage, precision in ((2, "bf16"), (3, "fp32")):
        engine = _engine(stage, precision, None)
        base = _train(engine, data)
        base_state = full_state(engine)
        engine.destroy()
        engine = _engine(stage, precision, 0.3)
        run = _train(engine, data)
        run_state = full_state(engine)
        split = engine.stage.master_split
        sides = {"host": set(), "device": set(), "state_host": set(), "state_device": set()}
        for gs in engine.stage.groups:
            for m in gs.masters:
                side = "host" if m in split.host else "device"
                sides[side].add(str(m.device))
                sides[f"state_{side}"].update(
                    str(t.device) for k, t in engine.optimizer.state[m].items() if k != "step"
                )
        grads = {
            str(t.device) for key in engine.stage.stepper._on_host for t in engine.stage.stepper._host_grad_buffers[key]
        }
        out[f"stage {stage}"] = {
            "same": _same(run, base) and all(torch.equal(a, b) for a, b in zip(run_state, base_state, strict=True)),
            "sides": {k: sorted(v) for k, v in sides.items()},
            "host_grads": sorted(grads),
            "placed": engine.memory_breakdown(by_device=True),
            "device_master_bytes": split.device_master_bytes(),
        }
        engine.destroy()
    return out


@pytest.mark.multiprocess
def test_device_strict_split_places_masters_state_and_copies() -> None:
    results = run_distributed(_strict, world_size=2, timeout=300, process_env={"DS_STRATEGY_DEVICE_STRICT": "1"})
    for r in results:
        assert r["device"] == "cpu:0", r
        for stage in ("stage 2", "stage 3"):
            s = r[stage]
            assert s["same"], (stage, s)
            assert s["sides"] == {
                "host": ["cpu"], "device": ["cpu:0"], "state_host": ["cpu"], "state_device": ["cpu:0"]
            }, (stage, s)  # fmt: skip
            assert s["device_master_bytes"] > 0 and s["placed"]["master"] >= s["device_master_bytes"], (stage, s)
            assert s["placed"]["master_host"] > 0 and s["placed"]["optimizer_state_host"] > 0, (stage, s)
        assert r["stage 2"]["host_grads"] == ["cpu"], r  # bf16 gradients: fp32 copies for the host side only


# ---------------------------------------------------------------------------------------------- no processes
def test_host_count_rounds_towards_the_host() -> None:
    from ds_strategy.runtime.zero.partial_offload import host_count

    assert host_count([10] * 10, 0.3) == 3  # exact
    assert host_count([10] * 10, 0.35) == 4  # the device keeps at most 65%: 6 masters
    assert host_count([10] * 10, 1.0) == 10
    assert host_count([10] * 10, 0.01) == 1  # anything above 0 offloads something
    assert host_count([100], 0.3) == 1  # one bucket: all of it on the host
    assert host_count([30, 10, 60], 0.4) == 2  # the last 60 fits in 60%; 70 would not
    assert host_count([30, 10, 60], 0.5) == 3  # 60 is more than half: everything stays on the host
    assert host_count([], 0.5) == 0


def test_config_accepts_ratios_and_refuses_what_is_not_built() -> None:
    from ds_strategy.config import ConfigError, load_config
    from ds_strategy.config.support import ACTED, SUPPORT

    def cfg(**zero: Any) -> dict[str, Any]:
        return {"train_batch_size": 4, "zero_optimization": {"stage": 3, **zero}}

    assert SUPPORT["zero_optimization.offload_optimizer.ratio"].kind == ACTED
    loaded = load_config(cfg(offload_optimizer={"device": "cpu", "ratio": 0.3}), world_size=1)
    assert loaded.zero_optimization.offload_optimizer.ratio == 0.3
    assert (
        load_config(cfg(offload_optimizer={"device": "cpu"}), world_size=1).zero_optimization.offload_optimizer.ratio
        == 1.0
    )
    for bad, phrase in (
        ({"offload_optimizer": {"device": "cpu", "ratio": 0}}, "expected a number > 0 and <= 1"),
        ({"offload_optimizer": {"device": "cpu", "ratio": 1.2}}, "expected a number > 0 and <= 1"),
        ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}}, "a partial offload to NVMe"),
        (
            {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "offload_param": {"device": "cpu"}},
            "parameter offload keeps no parameters",
        ),
    ):
        with pytest.raises(ConfigError, match=phrase):
            load_config(cfg(**bad), world_size=1)


def test_estimate_memory_counts_the_device_share() -> None:
    from ds_strategy import estimate_memory

    n, w = 1_000_000, 4
    full = estimate_memory(n, w, 2, True, "bf16")
    part = estimate_memory(n, w, 2, True, "bf16", offload_ratio=0.3)
    states = full.master + full.optimizer_state  # 4 + 8 bytes per element of the partition
    assert full.offloaded == states and part.offloaded == round(0.3 * states)
    assert part.on_device - full.on_device == states - part.offloaded  # (1 - r) of master + state on the device
    assert part.peak_on_device == full.peak_on_device + states - part.offloaded
    placed = part.as_dict(by_device=True)
    assert sum(placed.values()) == part.total
    assert placed["master_host"] + placed["optimizer_state_host"] == part.offloaded
    assert estimate_memory(n, w, 2, False, "bf16", offload_ratio=0.3) == estimate_memory(n, w, 2, False, "bf16")
    with pytest.raises(ValueError, match="offload_ratio must be in"):
        estimate_memory(n, w, 2, True, "bf16", offload_ratio=0.0)
