"""Pipeline training on 2 (pipe 2) and 4 (pipe 2 x data 2) processes equals one-process training.

The model (tests/runtime/pipe_common.py) ties a projection between stage 0 (first layer) and stage 1
(used transposed near the end), so the tie group's gradient sum and the global-norm clipping are both
exercised. Reference: the same layers in one process, the same per-layer seeds, the mean loss over every
micro-batch of every data-parallel rank, torch AdamW, clip_grad_norm_.

Tolerances (fp32): losses rtol 1e-5, weights atol 1e-6 - the pipeline sums per-micro-batch gradients
(scaled by 1/m) and averages over data-parallel ranks where the reference differentiates one mean, and
it steps the engine's AdamW: the same math, rounded in other places (observed differences ~1e-7).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, reference_run, specs

STEPS, MICRO, LR = 3, 2, 1e-2


def _train(
    rank: int, world: int, stages: int, gas: int, clip: float, precision: str, zero: int, no_room: bool = False
) -> dict[str, Any]:
    import warnings

    import ds_strategy
    from ds_strategy.pipe import PipelineEngine, PipelineModule
    from ds_strategy.runtime.pipe import p2p

    if no_room:  # /dev/shm too small for any channel: every link stays on the process group, with a warning
        p2p.shm_free_bytes = lambda: 0  # type: ignore[assignment]

    dp = world // stages
    module = PipelineModule(
        specs(), num_stages=stages, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform"
    )
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    cfg = pipe_config(micro=MICRO, gas=gas, lr=LR, clip=clip, stage=zero, **extra)
    engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
    assert isinstance(engine, PipelineEngine)
    d = module.topology().get_coord(rank).data
    batches = data(STEPS, dp, gas, MICRO)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in batches:
            losses.append(float(engine.train_batch(iter(step[d]))))
    if no_room:
        from ds_strategy.comm import shm_channel

        p2p.shm_free_bytes = shm_channel.shm_free_bytes
    from ds_strategy.utils import safe_get_full_fp32_param

    weights = {n: safe_get_full_fp32_param(p).clone() for n, p in module.named_parameters()}
    channels = len(engine.link.channels)
    norm = engine.get_global_grad_norm()
    engine.destroy()
    return {
        "channels_after_destroy": len(engine.link.channels),
        "losses": losses,
        "weights": weights,
        "first": engine.is_first_stage(),
        "last": engine.is_last_stage(),
        "negotiations": engine.link.negotiations,
        "channels": channels,
        "room_warnings": sum("/dev/shm has" in str(w.message) for w in caught),
        "norm": norm,
    }


@pytest.mark.parametrize(
    ("world", "gas", "clip", "zero", "shm"),
    [(2, 4, 0.0, 0, "1"), (2, 4, 0.0, 0, "0"), (2, 4, 0.0, 0, "no room"), (2, 3, 0.05, 1, "1"), (4, 4, 0.05, 1, "1")],
    ids=[
        "pipe2-zero0",
        "pipe2-zero0-process-group",
        "pipe2-zero0-no-shm-room",
        "pipe2-clip-zero1",
        "pipe2xdata2-clip-zero1",
    ],
)
def test_pipeline_matches_one_process(world: int, gas: int, clip: float, zero: int, shm: str) -> None:
    """Payloads travel through shared-memory channels (one per link direction on each rank: activations one
    way, gradients the other), or through the process group (DS_STRATEGY_SHM=0, or a /dev/shm without room
    for a channel, which the sender warns about): the same numbers."""
    results = run_distributed(
        _train,
        world_size=world,
        args=(2, gas, clip, "fp32", zero, shm == "no room"),
        timeout=120,
        env={"DS_STRATEGY_SHM": "0" if shm == "0" else "1"},
    )
    dp = world // 2
    ref_losses, ref_weights = reference_run(data(STEPS, dp, gas, MICRO), lr=LR, clip=clip)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        # one header per link direction: the activation link and the gradient link, never per micro-batch
        assert r["negotiations"] == 2
        assert r["channels"] == (2 if shm == "1" else 0)
        assert r["channels_after_destroy"] == 0
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-6, msg=name)
    if shm == "no room":  # the sending end of each link warned: stage 0 for activations, stage 1 for gradients
        assert [r["room_warnings"] for r in results] == [1, 1]
    # every parameter of the reference lives on some stage; the tied one on both, identical
    names = set().union(*(r["weights"] for r in results))
    assert names == set(ref_weights)
    tied = [r["weights"]["tied_modules.proj.weight"] for r in results]
    for t in tied[1:]:
        assert torch.equal(t, tied[0])
    if clip > 0:  # clipping was engaged: the global norm (every stage, tied weight once) exceeded it
        assert all(r["norm"] > clip for r in results)
        assert len({round(r["norm"], 9) for r in results}) == 1


class Boom(nn.Module):
    """Raises on its ``at``-th forward on the rank ``where`` (a global rank)."""

    def __init__(self, at: int, where: int) -> None:
        super().__init__()
        self.calls, self.at, self.where = 0, at, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.calls += 1
        if self.calls == self.at and dist.get_rank() == self.where:
            raise ValueError("boom in a layer")
        return x


def _failing(rank: int, world: int, boom_layer: int, where: int) -> str:
    import ds_strategy
    from ds_strategy.pipe import LayerSpec, PipelineModule, PipelineStageError

    layers = [LayerSpec(nn.Linear, 8, 8), Boom(6, where) if boom_layer == 1 else nn.Identity()]
    layers += [
        LayerSpec(nn.Linear, 8, 8),
        Boom(6, where) if boom_layer == 3 else nn.Identity(),
        LayerSpec(nn.Linear, 8, 4),
    ]
    module = PipelineModule(layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, _, _, _ = ds_strategy.initialize(model=module, config=pipe_config(micro=2, gas=4, lr=LR, clip=0.0))
    d = module.topology().get_coord(rank).data
    batches = data(3, world // 2, 4, 2)
    try:
        for step in batches:  # the 6th forward of the Boom layer is in the second batch
            engine.train_batch(iter(step[d]))
    except PipelineStageError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("world", "boom_layer", "where", "stage"),
    [(2, 3, 1, 1), (4, 1, 0, 0)],
    ids=["pipe2-last-stage-raises", "pipe2xdata2-one-first-stage-rank-raises"],
)
def test_failing_stage_fails_every_rank(world: int, boom_layer: int, where: int, stage: int) -> None:
    """Every rank raises PipelineStageError naming the stage and rank at fault; none hangs (the harness
    would report a hang as a timeout). In the 4-rank case only rank 0 raises: its data-parallel peer
    (rank 1) finishes its schedule, and stage 1's ranks are left waiting on receives."""
    messages = run_distributed(_failing, world_size=world, args=(boom_layer, where), timeout=120)
    for rank, msg in enumerate(messages):
        assert f"stage {stage} (rank {where}) raised ValueError: boom in a layer" in msg, msg
        assert f"this is rank {rank}," in msg


def _bf16_and_eval(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import PipelineModule

    out: dict[str, Any] = {}
    for precision in ("fp32", "bf16", "fp16"):
        module = PipelineModule(
            specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform"
        )
        extra: dict[str, Any] = {
            "fp32": {},
            "bf16": {"bf16": {"enabled": True}},
            "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "auto_cast": True}},
        }[precision]
        cfg = pipe_config(micro=MICRO, gas=4, lr=LR, clip=0.05, **extra)
        engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
        batches = data(STEPS, 1, 4, MICRO)
        losses = [float(engine.train_batch(iter(step[0]))) for step in batches]
        held_out = data(1, 1, 4, MICRO)[0][0]
        loss, logits = engine.eval_batch(iter(held_out), return_logits=True)
        per_micro = engine.eval_batch(iter(held_out), reduce_output=None)
        out[precision] = {
            "losses": losses,
            "eval": float(loss),
            "per_micro": per_micro.tolist(),
            "logits": None if logits is None else [t.float() for t in logits],
            "dtype": str(next(module.parameters()).dtype),
        }
    return out


def test_bf16_fp16_and_eval_batch() -> None:
    """eval_batch equals the reference model's loss on a held-out batch (fp32: rtol 1e-5), per micro-batch
    too; the last stage returns the logits. bf16 and fp16 train with 16-bit weights and track the fp32
    reference within their rounding (losses rtol 2e-2 for bf16's 8 mantissa bits, 5e-3 for fp16's 11)."""
    results = run_distributed(_bf16_and_eval, world_size=2, timeout=180)
    ref_losses, ref_weights = reference_run(data(STEPS, 1, 4, MICRO), lr=LR, clip=0.05)
    from tests.runtime.pipe_common import Reference

    model = Reference()
    model.load_state_dict(ref_weights)
    held_out = data(1, 1, 4, MICRO)[0][0]
    with torch.no_grad():
        ref_eval = [float(nn.functional.mse_loss(model(x), y)) for x, y in held_out]
        ref_logits = [model(x) for x, _ in held_out]
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["fp32"]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert r["fp32"]["eval"] == pytest.approx(sum(ref_eval) / 4, rel=1e-5)
        assert r["fp32"]["per_micro"] == pytest.approx(ref_eval, rel=1e-5)
        torch.testing.assert_close(torch.tensor(r["bf16"]["losses"]), torch.tensor(ref_losses), rtol=2e-2, atol=0)
        assert r["bf16"]["dtype"] == "torch.bfloat16"
        # fp16: loss scale 2**8, 11 mantissa bits; no overflow here, so every step applies
        torch.testing.assert_close(torch.tensor(r["fp16"]["losses"]), torch.tensor(ref_losses), rtol=5e-3, atol=0)
        assert r["fp16"]["dtype"] == "torch.float16"
        if rank == 1:
            for got, want in zip(r["fp32"]["logits"], ref_logits, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert r["fp32"]["logits"] is None


def _scheduled(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import PipelineModule

    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3}}
    cfg = pipe_config(micro=MICRO, gas=2, lr=LR, clip=0.0, scheduler=scheduler)
    engine, _, _, sched = ds_strategy.initialize(model=module, config=cfg)
    assert sched is not None
    lrs, losses = [], []
    for step in data(4, 1, 2, MICRO):
        lrs.append(engine.get_lr()[0])
        losses.append(float(engine.train_batch(iter(step[0]))))
    return {"lrs": lrs, "losses": losses}


def test_lr_scheduler_drives_every_stage() -> None:
    """The config's scheduler steps once per train_batch on every stage: the losses equal a reference that
    uses the same per-step learning rates (fp32, rtol 1e-5)."""
    results = run_distributed(_scheduled, world_size=2, timeout=120)
    lrs = results[0]["lrs"]
    assert results[1]["lrs"] == lrs and lrs == sorted(lrs) and lrs[1] < lrs[2] < lrs[3]  # warming up on both stages
    ref_losses, _ = reference_run(data(4, 1, 2, MICRO), lr=LR, clip=0.0, lrs=lrs)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_failing_stage_ends_the_launched_processes(tmp_path: Any) -> None:
    """Outside the harness too: under ds-launch the raising stage and its peer both exit with
    PipelineStageError (and the waiter thread of the peer does not keep its process alive)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "pipe_stage_raises.py"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"), DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "ds_strategy.launcher", "--num_procs", "2", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank, stage in ((0, 0), (1, 1)):
        assert (
            f"stage 1 (rank 1) raised ValueError: boom - every rank stops (this is rank {rank}, stage {stage})" in out
        )


def _config_block(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.config import ConfigError
    from ds_strategy.pipe import PipelineModule

    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    try:
        ds_strategy.initialize(
            model=module, config=pipe_config(micro=MICRO, gas=2, lr=LR, clip=0.0, pipeline={"stages": 4})
        )
        refused = "no error"
    except ConfigError as e:
        refused = str(e)
    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    block = {"stages": 2, "activation_checkpoint_interval": 2}
    cfg = pipe_config(micro=MICRO, gas=2, lr=LR, clip=0.0, pipeline=block)
    engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
    recomputed = 0
    inner = module.activation_checkpoint_func

    def counting(fn: Any, *args: Any) -> Any:
        nonlocal recomputed
        recomputed += 1
        return inner(fn, *args)

    module.activation_checkpoint_func = counting
    losses = [float(engine.train_batch(iter(step[0]))) for step in data(STEPS, 1, 2, MICRO)]
    return {"refused": refused, "interval": module.activation_checkpoint_interval, "losses": losses, "ckpt": recomputed}


def test_pipeline_config_block() -> None:
    """pipeline.stages must match the module (ConfigError naming the key otherwise);
    pipeline.activation_checkpoint_interval checkpoints runs of layers, and training still equals the
    reference exactly (recomputation changes nothing in fp32: rtol 1e-5)."""
    results = run_distributed(_config_block, world_size=2, timeout=120)
    ref_losses, _ = reference_run(data(STEPS, 1, 2, MICRO), lr=LR, clip=0.0)
    for r in results:
        assert "pipeline.stages=4 but the PipelineModule has num_stages=2" in r["refused"], r["refused"]
        assert r["interval"] == 2 and r["ckpt"] > 0
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
