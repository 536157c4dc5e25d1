"""Engine behaviour beyond parity: overflow handling, no_sync, unmanaged backward, boundaries, logging."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import batches, config, groups_of, make_model, micro_slice, runtime_log_messages

pytestmark = pytest.mark.multiprocess


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7) for n in a)


def _overflow(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    data = batches(8, 4 * world)
    out: dict[str, Any] = {}

    # fp16, dynamic scale 2**8, hysteresis 2, window 3; steps 2 and 3 get an inf loss.
    model = make_model()
    cfg = config(
        stage=1,
        precision="fp16",
        micro=4,
        gas=1,
        fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 2, "loss_scale_window": 3},
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 100, "warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_type": "linear"},
        },
    )
    engine, _, _, sched = rt.initialize(model=model, config=cfg)
    scales, applied, changed, iters = [], [], [], []
    for step, batch in enumerate(data[:7]):
        before = _weights(engine)
        loss = engine(*micro_slice(batch, 4, world, 0, rank))
        engine.backward(loss * float("inf") if step in (1, 2) else loss)
        engine.step()
        scales.append(engine.loss_scale)
        applied.append(engine.was_step_applied())
        changed.append(not _same(before, _weights(engine)))
        iters.append(sched.last_batch_iteration)
    out["fp16"] = {
        "scales": scales,
        "applied": applied,
        "changed": changed,
        "iters": iters,
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
    }
    engine.destroy()

    # At the minimum scale with hysteresis spent, an overflow is an error (never an endless skip loop).
    model = make_model()
    cfg = config(
        stage=2,
        precision="fp16",
        micro=4,
        gas=1,
        fp16={"enabled": True, "initial_scale_power": 1, "min_loss_scale": 1, "hysteresis": 1},
    )
    engine, _, _, _ = rt.initialize(model=model, config=cfg)
    messages = []
    for _ in range(2):
        engine.backward(engine(*micro_slice(data[0], 4, world, 0, rank)) * float("inf"))
        try:
            engine.step()
        except rt.LossScaleError as exc:
            messages.append(str(exc))
    out["min_scale"] = {"messages": messages, "scale": engine.loss_scale}
    engine.destroy()

    # bf16: no loss scaling, but an inf/nan gradient still skips the step.
    model = make_model()
    engine, _, _, _ = rt.initialize(model=model, config=config(stage=2, precision="bf16", micro=4, gas=1))
    before = _weights(engine)
    engine.backward(engine(*micro_slice(data[0], 4, world, 0, rank)) * float("nan"))
    engine.step()
    out["bf16"] = {
        "applied": engine.was_step_applied(),
        "unchanged": _same(before, _weights(engine)),
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scale,
    }
    engine.backward(engine(*micro_slice(data[1], 4, world, 0, rank)))
    engine.step()
    out["bf16"]["recovers"] = engine.was_step_applied() and not _same(before, _weights(engine))
    engine.destroy()
    return out


def test_overflow_skips_steps_and_drives_the_loss_scale() -> None:
    for out in run_distributed(_overflow, world_size=2):
        fp16 = out["fp16"]
        # step 2: overflow absorbed by hysteresis; step 3: scale halves; 3 clean steps later it doubles
        assert fp16["scales"] == [256, 256, 128, 128, 128, 128, 256]  # window + 1 clean steps (DeepSpeed)
        assert fp16["applied"] == [True, False, False, True, True, True, True]
        assert fp16["changed"] == fp16["applied"]  # a skipped step leaves every weight untouched
        assert fp16["iters"] == [0, 0, 0, 1, 2, 3, 4]  # the lr schedule only advances on applied steps
        assert fp16["skipped"] == 2 and fp16["global_steps"] == 7
        assert len(out["min_scale"]["messages"]) == 1
        assert "min_loss_scale=1" in out["min_scale"]["messages"][0]
        assert out["bf16"] == {"applied": False, "unchanged": True, "skipped": 1, "scale": 1.0, "recovers": True}


def _api(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    data = batches(3, 2 * 2 * world)
    out: dict[str, Any] = {}

    def run(stage: int, mode: str) -> dict[str, torch.Tensor]:
        model = make_model()
        engine, _, _, _ = rt.initialize(
            model=model, model_parameters=groups_of(model), config=config(stage=stage, micro=2, gas=2)
        )
        for batch in data:
            for m in range(2):
                x, y = micro_slice(batch, 2, world, m, rank)
                if mode == "no_sync":
                    with engine.no_sync():
                        engine.backward(engine(x, y))
                    assert not engine.stage.reducer.reduced  # nothing was reduced inside
                elif mode == "unmanaged":  # plain loss.backward(): the step reduces what is pending
                    (engine(x, y) / 2).backward()
                else:
                    engine.backward(engine(x, y))
                engine.step()
        weights = _weights(engine)
        engine.destroy()
        return weights

    for stage in (0, 1, 2):
        plain = run(stage, "plain")
        # stage 2 sums the two micro-steps before reducing instead of after: fp32 rounding differs
        out[f"unmanaged{stage}"] = (_close if stage == 2 else _same)(plain, run(stage, "unmanaged"))
        if stage < 2:
            out[f"no_sync{stage}"] = _same(plain, run(stage, "no_sync"))

    model = make_model()
    engine, _, _, _ = rt.initialize(
        model=model, config=config(stage=2, micro=2, gas=1, steps_per_print=2, wall_clock_breakdown=True)
    )
    try:
        with engine.no_sync():
            pass
    except RuntimeError as exc:
        out["no_sync_stage2"] = str(exc)
    with runtime_log_messages(logging.INFO) as records:
        x, y = micro_slice(data[0], 2, world, 0, rank)
        engine.set_gradient_accumulation_boundary(False)
        engine.backward(engine(x, y))
        engine.step()
        out["no_step_when_not_boundary"] = engine.global_steps == 0 and engine.micro_steps == 1
        engine.set_gradient_accumulation_boundary(None)  # the override lasts until reset, as DeepSpeed's
        for _ in range(4):
            engine.backward(engine(x, y))
            engine.step()
    out["records"] = records
    out["global"] = (engine.global_steps, engine.global_samples, engine.micro_steps)
    out["lr"] = engine.get_lr()
    engine.eval()
    out["eval"] = (engine.training, engine.module.training)
    engine.train()
    out["delegation"] = engine.fc1 is engine.module.fc1
    out["sizes"] = (
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
        engine.zero_optimization_stage(),
    )
    engine.destroy()
    return out


def test_engine_api() -> None:
    outs = run_distributed(_api, world_size=2)
    for rank, out in enumerate(outs):
        for stage in (0, 1, 2):
            assert out[f"unmanaged{stage}"], f"stage {stage}: loss.backward() + engine.step() differs"
        for stage in (0, 1):
            assert out[f"no_sync{stage}"], f"stage {stage}: no_sync changed the result"
        assert "not available with ZeRO stage 2" in out["no_sync_stage2"]
        assert out["no_step_when_not_boundary"]
        assert out["global"] == (4, 16, 5)
        assert out["lr"] == [1e-2]
        assert out["eval"] == (False, False) and out["delegation"]
        assert out["sizes"] == (4, 2, 1, 2)
        if rank == 0:
            progress = [r for r in out["records"] if r.startswith("step=")]
            assert len(progress) == 2 and "samples/sec=" in progress[0] and "loss=" in progress[0]
            assert any(r.startswith("time (ms) | forward:") and "backward:" in r for r in out["records"])
        else:
            assert out["records"] == []  # one rank speaks


def _deepspeed_signatures(rank: int, world: int, folder: str) -> dict[str, Any]:
    """What DeepSpeed's callers (transformers' Trainer among them) pass, on one rank."""
    import ds_strategy.runtime as rt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model[0].bias.requires_grad_(False)
    cfg = config(stage=3, micro=2, gas=2)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = rt.initialize(model=model, config=cfg)
    applied = []
    for _ in range(4):  # DeepSpeed: False after a step() call that ends no accumulation window
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
        applied.append(engine.was_step_applied())
    engine.save_checkpoint(folder, tag="t")
    out: dict[str, Any] = {"applied": applied}
    out["strict"] = engine.load_checkpoint(folder, tag="t", load_module_strict=False, custom_load_fn=None)[0]
    try:
        engine.load_checkpoint(folder, tag="t", custom_load_fn=lambda *a: None)
    except NotImplementedError as err:
        out["custom"] = str(err)
    engine.save_16bit_model(folder, "adapters.bin", exclude_frozen_parameters=True)
    out["keys"] = sorted(torch.load(f"{folder}/adapters.bin", weights_only=True))
    engine.destroy()
    return out


def test_deepspeed_signatures(tmp_path: Any) -> None:
    (out,) = run_distributed(_deepspeed_signatures, world_size=1, args=(str(tmp_path),))
    assert out["applied"] == [False, True, False, True]
    assert out["strict"].endswith("t")
    assert "custom_load_fn=...): DeepSpeed's hook" in out["custom"]
    assert out["keys"] == ["0.weight", "2.bias", "2.weight"]  # the frozen 0.bias left out


def _second_boundary_backward(rank: int, world: int, stage: int) -> str:
    import ds_strategy.runtime as rt

    engine, *_ = rt.initialize(model=make_model(), config=config(stage=stage, micro=2, gas=1))
    x, y = micro_slice(batches(1, 2 * world)[0], 2, world, 0, rank)
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError) as err:
        engine.backward(engine(x, y))
    engine.destroy()
    return str(err.value)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_second_backward_at_the_boundary_says_how_to_accumulate(stage: int) -> None:
    """DeepSpeed would reduce the sum twice; the engine refuses and names the ways to accumulate."""
    for message in run_distributed(_second_boundary_backward, world_size=2, args=(stage,)):
        assert "arrived after this step's gradients were already reduced" in message
        assert "gradient_accumulation_steps" in message and "fabric.no_backward_sync(model)" in message, message


class _SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids)).pow(2).mean()


def _sparse_embedding(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    import ds_strategy
    import ds_strategy.runtime as rt

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = rt.initialize(model=_SparseEmbedding(), config=config)
    for step in range(3):
        ids = torch.randint(0, 50, (2 * world, 3), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(ids[2 * rank : 2 * rank + 2]))
        engine.step()
    with ds_strategy.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return weights


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_sparse_embedding_trains_as_its_dense_gradient(stage: int) -> None:
    """nn.Embedding(sparse=True) (DeepSpeed trains it): the hook densifies its gradient into the flat buffers;
    the weights equal torch's SGD on the whole batch (it crashed in backward: 'aten::view' on SparseCPU)."""
    ref = _SparseEmbedding()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        ids = torch.randint(0, 50, (4, 3), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ((ref(ids[:2]) + ref(ids[2:])) / 2).backward()
        opt.step()
    for weights in run_distributed(_sparse_embedding, world_size=2, args=(stage,)):
        for name, p in ref.named_parameters():
            assert torch.allclose(weights[name], p.detach(), atol=1e-6), name
