"""The device-strict mode (``DS_STRATEGY_DEVICE_STRICT=1``): every collective of the engine, zero.Init,
GatheredParameters and checkpointing carries device memory only, as NCCL requires; and the mode itself
refuses host tensors wherever a collective is issued (see [Note: device-strict mode] in
ds_strategy/accelerator/strict.py).

The runs use their own worker pool whose processes start with the variable set (the mode is entered when
``ds_strategy.accelerator`` is imported). Inputs are moved to the engine's device as a GPU user would;
results are compared with the single-process torch reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import batches, config, full_masters, groups_of, make_model, micro_slice, reference_run

STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}
NO_SHM = {"DS_STRATEGY_SHM": "0"}  # torch.distributed for everything (the path a GPU group takes)
MICRO, GAS, STEPS, LR = 2, 2, 3, 1e-2


def run_strict(fn: Any, *args: Any, env: dict[str, str] | None = None, timeout: float = 240) -> list[Any]:
    return run_distributed(fn, world_size=2, args=args, env=env, process_env=STRICT, timeout=timeout)


# ---- the mode refuses host memory --------------------------------------------------------------------


def _refusals(rank: int, world: int) -> dict[str, Any]:
    from ds_strategy.accelerator import get_accelerator, strict
    from ds_strategy.comm import Communicator

    assert strict.ACTIVE
    dev = get_accelerator().device()
    out: dict[str, Any] = {"device": str(dev)}

    def refused(fn: Any) -> str:
        try:
            fn()
        except strict.DeviceStrictError as err:
            return str(err)
        return ""

    host = torch.ones(3)
    built = nn.Linear(2, 2)
    on_dev = torch.ones(3, device=dev)
    out["host all_reduce"] = refused(lambda: dist.all_reduce(host))
    out["c10d all_reduce"] = refused(lambda: dist.distributed_c10d.all_reduce(host))
    out["ProcessGroup.allreduce"] = refused(lambda: dist.group.WORLD.allreduce([host]).wait())  # type: ignore[union-attr]
    out["broadcast of a CPU-built module"] = refused(lambda: dist.broadcast(built.weight.data, 0))
    out["all_gather into host output"] = refused(
        lambda: dist.all_gather_into_tensor(torch.empty(2 * 3), on_dev)  # output on the host
    )
    out["host after copy_ from device"] = refused(lambda: dist.all_reduce(torch.zeros(3).copy_(on_dev)))
    out["device to host"] = refused(lambda: dist.all_reduce(on_dev.cpu()))
    out["device to('cpu')"] = refused(lambda: dist.all_reduce(on_dev.to("cpu")))
    shm = Communicator(fast_path=True)
    out["shm all_reduce"] = refused(lambda: shm.all_reduce(host))
    out["shm all_gather"] = refused(lambda: shm.all_gather_into_tensor(torch.empty(6), host))
    # Accepted: device memory, however it was made.
    moved = built.to(dev)
    accepted = [
        on_dev,
        torch.tensor([1.0, 2.0], device=dev),
        host.to(dev),
        on_dev * 2,
        on_dev[1:],
        on_dev.detach(),
        moved.weight.data,
        torch.empty(4, device=on_dev.device),  # tensor.device reads cpu:0, as cuda:0 would
        torch.zeros_like(on_dev),
    ]
    for t in accepted:
        dist.all_reduce(t)
    shm.all_reduce(on_dev.clone())
    shm.close()
    out["aliases"] = on_dev.to(dev) is on_dev  # .to(the device) of device memory: no copy, as on a GPU
    copied = on_dev.to(dev, copy=True)
    out["to(device tensor)"] = [
        strict.is_device_tensor(host.to(on_dev)),
        host.to(on_dev.double()).dtype == torch.float64,
        on_dev.to(on_dev) is on_dev,
        strict.is_device_tensor(on_dev.to(host)),
        strict.is_device_tensor(on_dev.to(dev, torch.float64)),
    ]
    out["copy=True"] = copied is not on_dev and strict.is_device_tensor(copied)
    obj: list[Any] = [None, None]
    dist.all_gather_object(obj, {"rank": rank})  # torch places the bytes itself: exempt
    out["objects"] = obj
    dist.barrier()
    return out


def test_strict_mode_refuses_host_tensors_in_every_collective_entry_point() -> None:
    for rank, r in enumerate(run_strict(_refusals)):
        assert r["device"] == "cpu:0"
        for what in (
            "host all_reduce",
            "c10d all_reduce",
            "ProcessGroup.allreduce",
            "broadcast of a CPU-built module",
            "all_gather into host output",
            "host after copy_ from device",
            "device to host",
            "device to('cpu')",
            "shm all_reduce",
            "shm all_gather",
        ):
            assert "device-strict mode" in r[what], (rank, what, r[what])
        assert "shape (3,)" in r["host all_reduce"] and "torch.float32" in r["host all_reduce"]
        assert "allreduce" in r["host all_reduce"]
        assert r["aliases"] is True and r["copy=True"] is True
        assert r["to(device tensor)"] == [True, True, True, False, True]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]


def _inactive(rank: int, world: int) -> bool:
    from ds_strategy.accelerator import get_accelerator, strict

    dist.all_reduce(torch.ones(2))  # host tensors are fine without the mode
    return strict.ACTIVE or get_accelerator().device() != torch.device("cpu")


def test_without_the_variable_nothing_is_installed() -> None:
    assert run_distributed(_inactive, world_size=2) == [False, False]


# ---- the engine at every stage, under the mode -------------------------------------------------------


def _train(rank: int, world: int, cfg: dict[str, Any], precision: str, empty_first: bool = False) -> dict[str, Any]:
    import ds_strategy

    data = batches(STEPS, MICRO * world * GAS)
    model = make_model()
    groups = groups_of(model)
    if empty_first:  # once: a host broadcast of its empty buffer, the grad norm all-reduced on its (host) device
        groups = [{"params": [], "weight_decay": 0.0}, *groups]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=groups, config=cfg)
    dev = engine.device
    from ds_strategy.accelerator import strict

    assert strict.ACTIVE and dev == torch.device("cpu", 0), dev
    losses = []
    for batch in data:
        total = torch.zeros((), device=dev)
        for m in range(GAS):
            x, y = (t.to(dev) for t in micro_slice(batch, MICRO, world, m, rank))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (GAS * world))
    masters = full_masters_on(engine, dev)
    reference = reference_run(
        make_model(),
        data,
        precision=precision,
        micro=MICRO,
        world=world,
        gas=GAS,
        lr=LR,
        clip=0.0,
        loss_scale=2.0**8 if precision == "fp16" else 1.0,
    )
    return {"losses": losses, "ref_losses": reference.losses, "masters": masters, "ref": reference.masters}


def full_masters_on(engine: Any, dev: torch.device) -> dict[str, torch.Tensor]:
    """``full_masters`` with its all-reduces on the device (the helper's own tensors are host scratch)."""
    original = dist.all_reduce

    def on_device(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        d = t.to(dev)
        work = original(d, *args, **kwargs)
        t.copy_(d)
        return work

    dist.all_reduce = on_device  # type: ignore[assignment]
    try:
        return {k: v.cpu() for k, v in full_masters(engine).items()}
    finally:
        dist.all_reduce = original  # type: ignore[assignment]


CASES = [
    pytest.param(stage, offload, "fp32", id=f"stage{stage}{'-offload' if offload else ''}")
    for stage in (0, 1, 2, 3)
    for offload in (False, True)
    if not (stage == 0 and offload)
] + [  # 16-bit: the loss scaler's overflow agreement rides on the gradient-norm all-reduce
    pytest.param(2, True, "bf16", id="stage2-offload-bf16"),
    pytest.param(3, False, "fp16", id="stage3-fp16"),
    pytest.param(0, False, "fp16", id="stage0-fp16"),
]
MASTER_RTOL = {"fp32": 1e-5, "bf16": 1e-4, "fp16": 1e-4}  # tests/runtime/test_parity.py's


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "torch"])
@pytest.mark.parametrize(("stage", "offload", "precision"), CASES)
def test_every_stage_trains_under_the_strict_mode(stage: int, offload: bool, precision: str, shm: bool) -> None:
    cfg = config(stage=stage, offload=offload, precision=precision, micro=MICRO, gas=GAS, lr=LR, bucket=200)
    if stage == 3:  # every bucket gathered per module (none persistent): the per-fetch labels are exercised
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    for r in run_strict(_train, cfg, precision, env=None if shm else NO_SHM):
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6)
        for name, ref in r["ref"].items():
            if name in r["masters"]:
                torch.testing.assert_close(r["masters"][name], ref, rtol=MASTER_RTOL[precision], atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_empty_first_param_group_issues_no_host_collective(stage: int) -> None:
    cfg = config(stage=stage, micro=MICRO, gas=GAS, lr=LR, bucket=200)
    for r in run_strict(_train, cfg, "fp32", True, env=NO_SHM):
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6)


# ---- zero.Init, GatheredParameters, stage-3 parameter offload, checkpoints -----------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))) * self.scale, y)


def _stage3_lifecycle(rank: int, world: int, root: str, offload_param: bool) -> dict[str, Any]:
    """zero.Init of a host-built model, GatheredParameters (read and modify), training with stage 3
    (optionally with parameter offload), checkpoint save, then loads into stage 3 and stage 2 (resharded)."""
    import ds_strategy
    from ds_strategy.zero import GatheredParameters, Init

    torch.manual_seed(0)
    with Init():
        model = Small()  # built on the host, partitioned through the device
    with GatheredParameters([model.scale], modifier_rank=0):
        if rank == 0:
            model.scale.data.mul_(2)
    cfg = config(stage=3, micro=MICRO, gas=1, lr=LR, bucket=200)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu" if offload_param else "none"}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu" if offload_param else "none"}
    cfg["comms_logger"] = {"enabled": True}  # records every collective it times (no collective of its own)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = engine.device
    for x, y in batches(2, MICRO * world, seed=3):
        x, y = (t[rank * MICRO : (rank + 1) * MICRO].to(dev) for t in (x, y))
        engine.backward(engine(x, y))
        engine.step()
    with GatheredParameters(list(model.parameters())):
        trained = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    engine.save_checkpoint(root, tag="s3")
    assert engine.save_16bit_model(root)  # the consolidated weights: gathered bucket by bucket
    saved = full_masters_on(engine, dev)
    logged = {stat.op for stat in engine.comms_logger.summary()}
    out: dict[str, Any] = {"trained": trained, "saved": saved, "loaded": {}, "logged": logged}
    for stage, bucket in ((3, 200), (2, 64)):
        torch.manual_seed(1)
        fresh = Small()
        cfg2 = config(stage=stage, micro=MICRO, gas=1, lr=LR, bucket=bucket)
        other, *_ = ds_strategy.initialize(model=fresh, model_parameters=fresh.parameters(), config=cfg2)
        other.load_checkpoint(root, tag="s3")
        out["loaded"][stage] = full_masters_on(other, other.device)
        other.save_checkpoint(root, tag=f"again-s{stage}")
    return out


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "torch"])
@pytest.mark.parametrize("offload_param", [False, True], ids=["device", "offload_param"])
def test_zero_init_gathered_parameters_and_checkpoints_under_the_strict_mode(
    tmp_path: Path, offload_param: bool, shm: bool
) -> None:
    results = run_strict(_stage3_lifecycle, str(tmp_path), offload_param, env=None if shm else NO_SHM)
    torch.testing.assert_close(results[0]["trained"], results[1]["trained"], rtol=0, atol=0)
    assert {"all_gather", "reduce_scatter"} <= results[0]["logged"], results[0]["logged"]
    consolidated = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    torch.testing.assert_close({k: v.float() for k, v in consolidated.items()}, results[0]["trained"], rtol=0, atol=0)
    for r in results:
        for stage in (3, 2):
            torch.testing.assert_close(r["loaded"][stage], r["saved"], rtol=0, atol=0)
    # The same model trained without zero.Init and without the mode, on one process, by plain torch.
    torch.manual_seed(0)
    ref = Small()
    with torch.no_grad():
        ref.scale.mul_(2)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for x, y in batches(2, MICRO * 2, seed=3):
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(results[0]["trained"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
