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


# ---- no host reads inside a step (issue 41: docs/zero3.md, "No host synchronisation in a step") ----------
# From the second optimizer step on, the engine brackets forward, backward, step and zero_grad with
# strict.no_host_reads: a read of device memory on the host (.item(), .tolist(), bool(), .cpu(), a copy into
# non-pinned host memory ...) raises, except the reads a step means to make, which strict.host_read_allowed
# lets through and counts (strict.allowed_reads).

SYNC_STEPS, SYNC_CLIP = 4, 0.05  # the clip engages at every step (the norms are ~0.1-0.5)


def _sync_free(rank: int, world: int, stage: int, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Train ``SYNC_STEPS`` optimizer steps per (precision, optimizer) case with gradient clipping; report the
    host reads let through after the first step and the results against the torch reference."""
    import ds_strategy
    from ds_strategy.accelerator import strict

    out = []
    data = batches(SYNC_STEPS, MICRO * world * GAS)
    for precision, optimizer in cases:
        model = make_model()
        cfg = config(stage=stage, precision=precision, micro=MICRO, gas=GAS, lr=LR, clip=SYNC_CLIP, bucket=200)
        if stage == 3:
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        client = None
        if optimizer != "config":  # a client torch AdamW: fused (skips on the device) or not (one read)
            del cfg["optimizer"]
            client = torch.optim.AdamW(groups_of(model), lr=LR, fused=optimizer == "torch-fused")
        engine, *_ = ds_strategy.initialize(
            model=model, model_parameters=groups_of(model) if client is None else None, optimizer=client, config=cfg
        )
        dev = engine.device
        losses, norms = [], []
        for step, batch in enumerate(data):
            if step == 1:
                strict.allowed_reads(reset=True)  # the first step records stage 3's order: not counted
            total = torch.zeros((), device=dev)
            for m in range(GAS):
                x, y = (t.to(dev) for t in micro_slice(batch, MICRO, world, m, rank))
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
            allowed = strict.allowed_reads()  # before the reads below, which are outside any step
            dist.all_reduce(total)
            losses.append(total.item() / (GAS * world))
            norms.append(engine.get_global_grad_norm())  # lazy: read here, outside the step
        reference = reference_run(
            make_model(), data, precision=precision, micro=MICRO, world=world, gas=GAS, lr=LR, clip=SYNC_CLIP,
            loss_scale=2.0**8 if precision == "fp16" else 1.0,
        )  # fmt: skip
        out.append({
            "case": (precision, optimizer), "allowed": allowed, "losses": losses, "norms": norms,
            "skipped": engine.skipped_steps, "masters": full_masters_on(engine, dev),
            "ref_losses": reference.losses, "ref_norms": reference.norms, "ref": reference.masters,
        })  # fmt: skip
        engine.destroy()
    return out


# The reads a step may make, by name (runtime/engine.py, runtime/zero/base.py, runtime/zero/divergence.py).
FP16_READ = "fp16: the step's [norm, overflow], one read per optimizer step (loss scale, skipped step)"
READ_SKIP = "the skip flag of an optimizer that cannot skip on the device (a torch optimizer without fused=True)"
TORCH_FUSED = "torch's fused optimizer moves found_inf to its parameters' device (no copy on a GPU)"
SUMMARY = "stage-3 divergence check: the iteration's summary copied to pinned host memory without waiting"
SYNC_CASES = [("bf16", "config"), ("fp32", "config"), ("fp16", "config"), ("bf16", "torch-fused"), ("fp32", "torch")]


def _check_sync_free(results: list[dict[str, Any]], stage: int, *, tagged: bool = False) -> None:
    later = SYNC_STEPS - 1  # optimizer steps inside the brackets
    for r in results:
        precision, optimizer = r["case"]
        allowed = dict(r["allowed"])
        # Stage 3's divergence check: one summary per iteration (backward), a pinned non-blocking copy on a
        # GPU, where headers carry the labels; none where the labels ride on the shared-memory gathers
        # (the iteration closes with one more labelled gather, which the path compares itself).
        summaries = allowed.pop(SUMMARY, 0)
        assert summaries == (later * GAS if stage == 3 and not tagged else 0), (r["case"], r["allowed"])
        if precision == "fp16":
            expected = {FP16_READ: later}  # exactly one read per optimizer step
        elif optimizer == "torch":
            expected = {READ_SKIP: later}  # documented: a torch optimizer without fused=True cannot skip on the device
        elif optimizer == "torch-fused":
            # An artifact of cpu:0 vs cpu under the mode, once per param group (no copy on a GPU).
            expected = {TORCH_FUSED: later * 2}
        else:
            expected = {}  # bf16 / fp32 with ds_strategy's optimizer: nothing at all
        assert allowed == expected, (r["case"], r["allowed"])
        assert r["skipped"] == 0, r["case"]
        assert max(r["ref_norms"]) > SYNC_CLIP, "the clip must engage"
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6, msg=str(r["case"]))
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=1e-4, atol=1e-6, msg=str(r["case"]))
        for name, ref in r["ref"].items():
            if name in r["masters"]:
                torch.testing.assert_close(
                    r["masters"][name], ref, rtol=MASTER_RTOL[precision], atol=1e-6, msg=f"{r['case']} {name}"
                )


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_reads_nothing_on_the_host_stages_1_2(stage: int) -> None:
    for results in run_strict(_sync_free, stage, SYNC_CASES, env=NO_SHM):
        _check_sync_free(results, stage)


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "torch"])
def test_a_step_reads_nothing_on_the_host_stage_3(shm: bool) -> None:
    for results in run_strict(_sync_free, 3, SYNC_CASES, env=None if shm else NO_SHM):
        _check_sync_free(results, 3, tagged=shm)


class _Reads(nn.Module):
    """``Small`` whose forward (or a gradient hook, in backward) reads a device tensor on the host once armed."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.inner = Small()
        self.where = where
        self.armed = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inner.fc1(x)
        if self.armed and self.where == "forward" and h.abs().sum().item() < 0:  # the deliberate host read
            h = h * 2
        if self.armed and self.where == "backward":
            h.register_hook(lambda g: g * (1.0 if float(g.norm()) >= 0 else 0.0))
        return torch.nn.functional.mse_loss(self.inner.fc2(torch.relu(h)) * self.inner.scale, y)


def _deliberate_read(rank: int, world: int, stage: int, where: str) -> str:
    import ds_strategy
    from ds_strategy.accelerator import strict

    torch.manual_seed(0)
    model = _Reads(where)
    cfg = config(stage=stage, precision="bf16", micro=MICRO, gas=1, lr=LR, clip=1.0, bucket=200)
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = engine.device
    for step, (x, y) in enumerate(batches(3, MICRO * world, seed=3)):
        x, y = (t[rank * MICRO : (rank + 1) * MICRO].to(dev) for t in (x, y))
        model.armed = step == 0 or step == 2  # the first step is not checked (stage 3 records its order)
        try:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        except strict.DeviceStrictError as err:
            assert step == 2, f"raised at step {step}"
            engine.destroy(release_params=False)
            return str(err)
    return ""


@pytest.mark.parametrize(("stage", "where"), [(3, "forward"), (3, "backward"), (1, "forward")])
def test_a_host_read_inside_a_step_raises_naming_the_call_site(stage: int, where: str) -> None:
    for message in run_strict(_deliberate_read, stage, where, env=NO_SHM):
        assert f"host read inside ZeroEngine.{where}" in message, message
        read = "Tensor.item()" if where == "forward" else "float()"
        assert read in message and "device tensor" in message, message
        # The call site: this file, the line of the read, the function (the hook's lambda in backward).
        assert "test_device_strict.py:" in message, message
        assert ("in forward" if where == "forward" else "in <lambda>") in message, message


def _nan_step_skipped_on_the_device(rank: int, world: int, stage: int) -> dict[str, Any]:
    """bf16: a NaN gradient at the second step is skipped on the device, no host read; counted when asked."""
    import ds_strategy
    from ds_strategy.accelerator import strict

    torch.manual_seed(0)
    model = Small()
    cfg = config(stage=stage, precision="bf16", micro=MICRO, gas=1, lr=LR, clip=1.0, bucket=200)
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    dev = engine.device
    data = [(x[rank * MICRO : (rank + 1) * MICRO].to(dev), y[rank * MICRO : (rank + 1) * MICRO].to(dev))
            for x, y in batches(3, MICRO * world, seed=3)]  # fmt: skip
    out: dict[str, Any] = {}

    def step(x: torch.Tensor, y: torch.Tensor, nan: bool = False) -> None:
        loss = engine(x, y)
        engine.backward(loss * float("nan") if nan and rank == 1 else loss)  # one rank's gradient: all skip
        engine.step()

    step(*data[0])
    before = full_masters_on(engine, dev)
    strict.allowed_reads(reset=True)
    step(*data[1], nan=True)
    out["allowed"] = strict.allowed_reads()
    out["applied"] = engine.was_step_applied()
    out["skipped"] = engine.skipped_steps
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in full_masters_on(engine, dev).items())
    step(*data[2])
    out["recovers"] = engine.was_step_applied() and engine.skipped_steps == 1
    out["finite"] = all(bool(torch.isfinite(v).all()) for v in full_masters_on(engine, dev).values())
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_bf16_nan_step_is_skipped_on_the_device(stage: int) -> None:
    for r in run_strict(_nan_step_skipped_on_the_device, stage, env=NO_SHM):
        allowed = {k: v for k, v in r["allowed"].items() if k != SUMMARY}
        assert allowed == {}, r["allowed"]
        assert r["applied"] is False and r["skipped"] == 1 and r["unchanged"], r
        assert r["recovers"] and r["finite"], r


def _diverges_later(rank: int, world: int) -> None:
    """Rank 1 skips the block from the third iteration on: after the first iteration, whose headers are
    compared eagerly, the comparison is on the device (runtime/zero/divergence.py)."""
    import ds_strategy.runtime as rt
    from tests.runtime.common import make_tied, token_batches

    model = make_tied()
    cfg = config(stage=3, micro=MICRO, gas=1, lr=LR, bucket=200)
    cfg["zero_optimization"].update(
        stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0
    )
    engine, *_ = rt.initialize(model=model, config=cfg)
    dev = engine.device
    x, y = (t[:MICRO].to(dev) for t in token_batches(1, MICRO)[0])
    for it in range(4):
        if rank == 1 and it == 2:
            model.block.forward = lambda h: torch.zeros_like(h)  # type: ignore[method-assign]
        engine.backward(engine(x, y))
        engine.step()


@pytest.mark.parametrize("shm", [True, False], ids=["labels-on-shm-gathers", "header-all-reduce"])
def test_a_later_divergence_still_names_the_ranks_and_modules(shm: str) -> None:
    from tests.harness import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        run_strict(_diverges_later, env={"DS_STRATEGY_GATHER_TIMEOUT": "5", **({} if shm else NO_SHM)}, timeout=120)
    text = str(info.value)
    assert "ZeRO-3: ranks diverged at parameter gather" in text, text
    assert "rank 0 gathers 'block.0'" in text and "rank 1 gathers 'ln'" in text, text  # rank 1 skipped the block
    assert "device-strict mode" not in text, text


# ------------------------------------------------------------------ the divergence check's device log
def _with_device_log(fn: Any, *args: Any) -> Any:
    """Run ``fn`` with stage 3's divergence check in its GPU mode (the device log, [Note: the device log] in
    runtime/zero/divergence.py) on this CPU: one exchange per iteration instead of a header per fetch."""
    from ds_strategy.runtime.zero.divergence import DivergenceCheck

    DivergenceCheck.DEVICE_LOG = True
    try:
        return fn(*args)
    finally:
        DivergenceCheck.DEVICE_LOG = None


def _sync_free_device_log(rank: int, world: int) -> list[dict[str, Any]]:
    return _with_device_log(_sync_free, rank, world, 3, SYNC_CASES)


def test_a_step_reads_nothing_on_the_host_stage_3_with_the_device_log() -> None:
    for results in run_strict(_sync_free_device_log, env=NO_SHM):
        _check_sync_free(results, 3)


def _header_collectives(rank: int, world: int, log: bool) -> dict[str, int]:
    import ds_strategy
    from ds_strategy.runtime.zero.divergence import DivergenceCheck

    DivergenceCheck.DEVICE_LOG = log
    try:
        model = make_model()
        cfg = config(stage=3, micro=MICRO, gas=1, lr=LR, bucket=200)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        cfg["comms_logger"] = {"enabled": True}
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=groups_of(model), config=cfg)
        counts = {}
        check = engine.stage.gatherer.divergence
        for step, batch in enumerate(batches(3, MICRO * world)):
            engine.comms_logger.reset()
            seq = check._seq
            x, y = micro_slice(batch, MICRO, world, 0, rank)
            engine.backward(engine(x, y))
            engine.step()
            summary = {s.op: s.count for s in engine.comms_logger.summary()}
            counts[f"step{step}"] = summary.get("all_reduce", 0)
            counts[f"gathers{step}"] = summary.get("all_gather", 0)
            counts[f"fetches{step}"] = check._seq - seq
        engine.destroy()
        return counts
    finally:
        DivergenceCheck.DEVICE_LOG = None


def test_the_device_log_takes_one_collective_per_iteration_where_headers_take_one_per_fetch() -> None:
    headers = run_distributed(_header_collectives, world_size=2, args=(False,), env=NO_SHM)[0]
    log = run_distributed(_header_collectives, world_size=2, args=(True,), env=NO_SHM)[0]
    fetches = headers["fetches2"]
    assert fetches > 2 and log["fetches2"] == fetches and log["gathers2"] == headers["gathers2"], (headers, log)
    # Stage 3's other all-reduces are the same in both: headers add one per fetch, the log one per iteration.
    assert headers["step2"] - fetches == log["step2"] - 1, (headers, log)
    assert log["step0"] == headers["step0"], (headers, log)  # the first iteration compares headers eagerly


class _Triplets(nn.Module):
    """Three Linear layers of one shape, called in a per-rank order: same-size gathers pair up wrongly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.order = "ab"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = getattr(self, name)(x)
        return torch.nn.functional.mse_loss(x, y)


def _same_size_divergence(rank: int, world: int) -> None:
    import ds_strategy

    def run() -> None:
        torch.manual_seed(0)
        model = _Triplets()
        cfg = config(stage=3, micro=MICRO, gas=1, lr=LR, bucket=200)
        cfg["zero_optimization"].update(
            stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0
        )
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x, y = torch.randn(MICRO, 8), torch.randn(MICRO, 8)
        for it in range(4):
            # Both ranks leave the recorded order (a, b) at the same fetch, so both free each unit after use
            # and issue the same collectives: only the modules differ.
            model.order = ("ba" if rank == 0 else "ca") if it == 2 else "ab"
            engine.backward(engine(x, y))
            engine.step()

    _with_device_log(run)


def test_the_device_log_names_the_ranks_and_modules_of_a_same_size_divergence() -> None:
    from tests.harness import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        run_strict(_same_size_divergence, env=NO_SHM, timeout=120)
    text = str(info.value)
    assert "ZeRO-3: ranks diverged at parameter gather" in text, text
    assert "rank 0 gathers 'b'" in text and "rank 1 gathers 'c'" in text, text
    assert "device-strict mode" not in text, text
