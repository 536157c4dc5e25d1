"""``Fabric(strategy="zero3")``: the Fabric face of the engine against Fabric's own DDP on the same data.

Tolerances: fp32 everywhere, losses and gradient norms rtol 1e-5 (as tests/runtime/test_parity.py: the
engine sums per-rank mean gradients in buckets where DDP averages in its own order, so they differ in
fp32 rounding only). Every distributed check runs inside a few harness calls (see fabric_common.py),
each checking a lot.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from ds_strategy.lightning import ZeroFabricStrategy
from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV
from tests.lightning.fabric_common import (
    Block,
    TinyGPT,
    assert_close_lists,
    discriminator,
    gan_loop,
    generator,
    gpt_loop,
    make_fabric,
    token_batches,
)

RTOL = 1e-5
KW: dict[str, Any] = {"env": ELASTIC_ENV, "init_process_group": False}


def _quiet(fn: Any) -> Any:
    """A worker body without Lightning's notes (sharded strategies, seeding) in its output."""

    def run(*args: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)

    run.__name__ = run.__qualname__ = fn.__name__
    return run


# ---------------------------------------------------------------------- without processes
def test_names_are_registered_in_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import ds_strategy  # noqa: F401
    from ds_strategy.lightning import STRATEGY_NAMES, ZeroFabricPrecision, ZeroFabricStrategy

    for name in STRATEGY_NAMES:
        assert STRATEGY_REGISTRY[name]["strategy"] is ZeroFabricStrategy, name
    fabric = Fabric(strategy="zero3_offload", accelerator="cpu", devices=2, precision="bf16-mixed")
    strategy = fabric.strategy
    assert isinstance(strategy, ZeroFabricStrategy) and strategy.stage == 3
    assert strategy.raw_config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert isinstance(strategy.precision, ZeroFabricPrecision) and strategy.precision.precision == "bf16-mixed"
    for flag, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("32-true", torch.float32)):
        plugin = Fabric(strategy="zero1", accelerator="cpu", devices=2, precision=flag).strategy.precision
        assert isinstance(plugin, ZeroFabricPrecision) and plugin.dtype == dtype, flag


def test_import_ds_strategy_then_fabric_registers_the_names() -> None:
    """The lazy hook: ``import ds_strategy`` imports no Lightning; importing Fabric afterwards (which runs
    lightning/__init__.py) fills Fabric's registry too, in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, ds_strategy; assert 'lightning' not in sys.modules\n"
        "from lightning.fabric import Fabric\n"
        "f = Fabric(strategy='zero3', accelerator='cpu', devices=2)\n"
        "print(type(f.strategy).__name__, f.strategy.stage)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "ZeroFabricStrategy 3"


def test_unsupported_settings_name_what_works() -> None:
    import ds_strategy.lightning  # noqa: F401
    from ds_strategy.lightning import ZeroFabricStrategy

    with pytest.raises(TypeError, match="ZeroFabricStrategy does not support 64-bit"):
        Fabric(strategy="zero2", accelerator="cpu", devices=2, precision="64-true")
    with pytest.raises(ValueError, match=r'"optimizer" block.*fabric.setup\(model, optimizer\)'):
        ZeroFabricStrategy(config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match=r"ZeroFabricStrategy\(stage=4\)"):
        ZeroFabricStrategy(stage=4)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the GPT loop against DDP
@_quiet
def _gpt_runs(rank: int, world: int) -> dict[str, Any]:
    """One worker call: the same LitGPT-style loop (2 micro-batches accumulated with no_backward_sync,
    clipping, AdamW) under DDP, zero1, zero2 and zero3 (model built under init_module), plus the
    collectives."""
    from ds_strategy.runtime.activation_checkpointing import is_checkpointed
    from ds_strategy.runtime.zero.init import init_shard

    batches = token_batches(steps=3, micro=2, rank=rank, world=world)
    out: dict[str, Any] = {}
    for name in ("ddp", "zero1", "zero2", "zero3", "zero3-recompute", "zero3-compiled"):
        strategy: Any = name
        if name == "zero3-recompute":  # activation checkpointing of every Block: recomputation is exact
            strategy = ZeroFabricStrategy(stage=3, activation_checkpointing_policy={Block})
        if name == "zero3-compiled":  # aot_eager: the traced graphs run as eager ops (inductor adds codegen only)
            strategy = ZeroFabricStrategy(stage=3, compile={"backend": "aot_eager"})
        fabric = make_fabric(strategy, world)
        torch.manual_seed(0)
        with fabric.init_module():
            model = TinyGPT()
        if name == "zero3":
            shards = [init_shard(p) for p in model.parameters()]
            out["shard_numel"] = sum(s.shard.numel() for s in shards if s is not None)
            out["full_numel"] = sum(s.numel for s in shards if s is not None)
            out["all_partitioned"] = all(s is not None for s in shards)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        out[name] = gpt_loop(fabric, model, optimizer, batches, max_norm=0.3)
        out[name]["recomputed"] = sum(is_checkpointed(m) for m in model.modules())
        out[name]["compiled"] = sum(hasattr(m, "_ds_compiled_forward") for m in model.modules())
        if name == "zero3":
            t = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
            out["all_reduce"] = float(t)
            out["broadcast"] = fabric.broadcast(f"from rank {rank}", src=1)
            fabric.barrier()
        fabric.strategy.teardown()
    return out


@pytest.mark.multiprocess
def test_gpt_loop_matches_ddp_at_every_stage() -> None:
    results = run_distributed(_gpt_runs, 2, **KW)
    for rank, r in enumerate(results):
        for name in ("zero1", "zero2", "zero3", "zero3-recompute", "zero3-compiled"):
            assert_close_lists(r[name]["losses"], r["ddp"]["losses"], RTOL, f"rank {rank} {name} losses")
            assert_close_lists(r[name]["norms"], r["ddp"]["norms"], RTOL, f"rank {rank} {name} grad norms")
        assert r["zero3-recompute"]["recomputed"] == 2 and r["zero3"]["recomputed"] == 0  # the two Blocks
        assert r["zero3-compiled"]["compiled"] == 2 and r["zero3"]["compiled"] == 0  # each Block's forward
        assert min(r["ddp"]["norms"]) > 0.3  # the clipping was active
        assert r["ddp"]["losses"][-1] < r["ddp"]["losses"][0]
        # init_module at stage 3: every parameter a shard, each rank holding half (padded) of the model
        assert r["all_partitioned"]
        assert r["full_numel"] / 2 <= r["shard_numel"] < r["full_numel"] / 2 + 64
        assert r["all_reduce"] == 3.0
        assert r["broadcast"] == "from rank 1"
    assert results[0]["zero3"]["losses"] != results[1]["zero3"]["losses"]  # each rank had its own data


# ---------------------------------------------------------------------- several engines in one process
@_quiet
def _gan_runs(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    """A GAN (two engines, alternating) under DDP and zero3 (and zero2), a frozen teacher engine without
    optimizer, and the errors that name what works."""
    out: dict[str, Any] = {}
    for name in ("ddp", "zero2", "zero3", "zero2-bf16"):
        fabric = make_fabric(name.removesuffix("-bf16"), world, "bf16-mixed" if name.endswith("bf16") else "32-true")
        torch.manual_seed(1)
        with fabric.init_module():
            g, d = generator(), discriminator()
        opt_g = torch.optim.Adam(g.parameters(), lr=1e-2)
        opt_d = torch.optim.SGD(d.parameters(), lr=5e-2, momentum=0.9)
        g, opt_g = fabric.setup(g, opt_g)
        d, opt_d = fabric.setup(d, opt_d)
        out[name] = gan_loop(fabric, g, d, opt_g, opt_d, steps=4, rank=rank)
        out[name]["dtype"] = str(getattr(g._forward_module, "compute_dtype", "ddp"))
        if name == "zero3":
            with pytest.raises(
                ValueError, match=r"name the one this loss trains: fabric.backward\(loss, model=model\)"
            ):
                fabric.backward(d(torch.zeros(1, 6)).sum())
            torch.manual_seed(2)
            plain_teacher = generator()
            torch.manual_seed(2)
            with fabric.init_module():
                teacher = generator()
            teacher = fabric.setup(teacher)  # no optimizer: an evaluation engine, partitioned
            z = torch.ones(3, 4)
            with torch.no_grad():
                out["teacher"] = (teacher(z), plain_teacher(z))
            with pytest.raises(RuntimeError, match=r"model, optimizer = fabric.setup\(model, optimizer\)"):
                fabric.setup_optimizers(torch.optim.SGD(plain_teacher.parameters(), lr=0.1))
            two = generator()
            opts = [torch.optim.SGD(two.parameters(), lr=0.1) for _ in range(2)]
            with pytest.raises(ValueError, match=r"one optimizer; got 2\. .*GAN-style"):
                fabric.setup(two, *opts)
            with pytest.raises(NotImplementedError, match=r"max_norm=\.\.\.\) instead of clip_val"):
                fabric.clip_gradients(g, opt_g, clip_val=1.0)
            with pytest.raises(ValueError, match=r"put the model in the state too"):
                fabric.save(tmp_dir, {"opt_g": opt_g})
        fabric.strategy.teardown()
    return out


@pytest.mark.multiprocess
def test_gan_two_engines_each_match_ddp(tmp_path: Path) -> None:
    for rank, r in enumerate(run_distributed(_gan_runs, 2, args=(str(tmp_path),), **KW)):
        for name in ("zero2", "zero3"):
            assert_close_lists(r[name]["d"], r["ddp"]["d"], RTOL, f"rank {rank} {name} discriminator")
            assert_close_lists(r[name]["g"], r["ddp"]["g"], RTOL, f"rank {rank} {name} generator")
        # bf16-mixed: the engine computes in bf16 (fp32 masters); the first losses agree to bf16 precision
        assert r["zero2-bf16"]["dtype"] == "torch.bfloat16" and r["zero2"]["dtype"] == "torch.float32"
        assert_close_lists(r["zero2-bf16"]["d"][:1], r["ddp"]["d"][:1], 2e-2, f"rank {rank} bf16 discriminator")
        got, ref = r["teacher"]
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------- checkpoints
@_quiet
def _ckpt_run(rank: int, world: int, path: str, phase: str) -> dict[str, Any]:
    """phase "save": 2 steps, save, 2 more (the reference continuation); then, in the same processes, a fresh
    model loads the checkpoint and runs the same 2 steps. phase "load1": one process loads it (resharded)."""
    batches = token_batches(steps=4, micro=1, rank=rank, world=world)

    def fresh(fabric: Fabric, seed: int) -> tuple[Any, Any, Any]:
        torch.manual_seed(seed)
        with fabric.init_module():
            model = TinyGPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer = fabric.setup(model, optimizer)
        return model, optimizer, scheduler

    out: dict[str, Any] = {}
    if phase == "save":
        fabric = make_fabric("zero3", world)
        model, optimizer, scheduler = fresh(fabric, 0)
        gpt_loop(fabric, model, optimizer, batches[:2])
        scheduler.step()
        fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
        out["continued"] = gpt_loop(fabric, model, optimizer, batches[2:])["losses"]
        fabric.strategy.teardown()
    fabric = make_fabric("zero3", world)
    model, optimizer, scheduler = fresh(fabric, 5)  # other weights: the load must replace them all
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(path, state)
    out["step"], out["remainder"], out["lr"] = state["step"], remainder, optimizer.param_groups[0]["lr"]
    out["resumed"] = gpt_loop(fabric, model, optimizer, batches[2:])["losses"]
    out["files"] = sorted(p.name for p in Path(path).iterdir())
    if (
        phase == "load1"
    ):  # load_raw: a single file of full weights (as DDP or ds-zero-to-fp32 write) into a fresh engine
        full = model._forward_module.full_state_dict(rank=0)
        torch.save(full, Path(path).parent / "full.pt")
        other, _, _ = fresh(fabric, 7)
        fabric.load_raw(Path(path).parent / "full.pt", other)
        out["load_raw_equal"] = all(
            torch.equal(full[k], v) for k, v in other._forward_module.full_state_dict(rank=0).items()
        )
        plain = fabric.load(path)  # no state: the plain entries; a sharded one's key says how to load it
        out["plain"] = {k: v for k, v in plain.items() if k != "scheduler"}
        with pytest.raises(KeyError) as missing:
            plain["model"]
        out["missing"] = str(missing.value)
    fabric.strategy.teardown()
    return out


@pytest.mark.multiprocess
def test_save_load_resumes_identically_and_reshards(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    two = run_distributed(_ckpt_run, 2, args=(path, "save"), **KW)
    for rank, r in enumerate(two):
        assert r["files"] == ["fabric_state.pt", "model"]
        assert r["step"] == 2 and r["remainder"] == {}
        assert r["lr"] == pytest.approx(5e-3)  # the scheduler's state came back with the optimizer's groups
        assert_close_lists(r["resumed"], r["continued"], RTOL, f"rank {rank} resumed")
    # saved by 2 ranks, loaded by 1 (the union of both ranks' batches): the mean of the 2-rank losses
    one = run_distributed(_ckpt_run, 1, args=(path, "load1"), **KW)[0]
    mean = [(a + b) / 2 for a, b in zip(two[0]["continued"], two[1]["continued"], strict=True)]
    assert one["step"] == 2 and one["load_raw_equal"]
    assert one["plain"] == {"step": 2} and "'model' is sharded over the ranks" in one["missing"], one["missing"]
    assert_close_lists(one["resumed"], mean, RTOL, "world size 1 resumed")


@_quiet
def _from_ddp_files(rank: int, world: int, folder: str) -> dict[str, list[float]]:
    """DDP: 2 steps, then the model's and the optimizer's plain state dicts to files, 2 more steps (the
    reference). zero3: a fresh model takes both files with fabric.load_raw and runs the same 2 steps."""
    batches = token_batches(steps=4, micro=1, rank=rank, world=world)
    root = Path(folder)

    def fresh(strategy: str, seed: int) -> tuple[Fabric, Any, Any]:
        fabric = make_fabric(strategy, world)
        torch.manual_seed(seed)
        model = TinyGPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = fabric.setup(model, optimizer)
        return fabric, model, optimizer

    fabric, model, optimizer = fresh("ddp", 0)
    gpt_loop(fabric, model, optimizer, batches[:2])
    if rank == 0:
        torch.save(model.module.state_dict(), root / "model.pt")
        torch.save(optimizer.state_dict(), root / "optimizer.pt")
    fabric.barrier()
    continued = gpt_loop(fabric, model, optimizer, batches[2:])["losses"]
    fabric, model, optimizer = fresh("zero3", 5)
    fabric.load_raw(root / "model.pt", model)
    fabric.load_raw(root / "optimizer.pt", optimizer)
    resumed = gpt_loop(fabric, model, optimizer, batches[2:])["losses"]
    fabric.strategy.teardown()
    return {"continued": continued, "resumed": resumed}


@pytest.mark.multiprocess
def test_load_raw_takes_a_ddp_optimizer_state(tmp_path: Path) -> None:
    """Fabric DDP's plain model and optimizer files into zero3: the Adam moments continue (fresh ones would
    change the second loss)."""
    for rank, r in enumerate(run_distributed(_from_ddp_files, 2, args=(str(tmp_path),), **KW)):
        assert_close_lists(r["resumed"], r["continued"], RTOL, f"rank {rank} resumed from DDP's files")
