"""The config keys that used to be accepted and ignored now act (config/support.py classifies them "acted"):
fp16.auto_cast, ignore_unused_parameters, checkpoint.tag_validation, reduce_bucket_size at stage 1 (and
allgather_bucket_size at stage 2), stage3_model_persistence_threshold, optimizer.params.torch_adam and
sub_group_size. Each case shows the effect against what the key's absence (or another value) does.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.harness import run_distributed
from tests.runtime.common import batches, config, engine_run, make_model, make_tied, token_batches


class _Recorder(nn.Module):
    """Records the dtypes its forward receives, then computes in its weight's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.seen: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *, bias: torch.Tensor) -> torch.Tensor:
        self.seen.append((x.dtype, bias.dtype, bool(torch.isinf(mask).any())))
        dtype = self.fc.weight.dtype
        return (self.fc(x.to(dtype)) + bias.to(dtype)).float().square().mean()


def _auto_cast(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out = {}
    x, bias = torch.randn(2, 4), torch.zeros(1)
    mask = torch.full((2, 4), torch.finfo(torch.float32).min)  # a typical additive attention mask
    cases = {
        "fp16": {"fp16": {"enabled": True}},
        "fp16_auto_cast": {"fp16": {"enabled": True, "auto_cast": True}},
        "bf16": {"bf16": {"enabled": True}},
    }
    for name, precision in cases.items():
        cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD"}, **precision}
        engine, _, _, _ = rt.initialize(model=_Recorder(), config=cfg)
        engine(x, mask, bias=bias)
        out[name] = engine.module.seen[-1]
        engine.destroy()
    return out


def test_fp16_auto_cast_follows_deepspeed() -> None:
    out = run_distributed(_auto_cast, world_size=2)[0]
    # auto_cast false (the default): inputs reach the module as given; the fp32 mask stays finite.
    assert out["fp16"] == (torch.float32, torch.float32, False)
    # auto_cast true: floating positional inputs become fp16 (the mask's finfo.min becomes -inf, as in
    # DeepSpeed), keyword inputs are left alone.
    assert out["fp16_auto_cast"] == (torch.float16, torch.float32, True)
    # bf16: positional and keyword inputs are cast (a ds_strategy convenience DeepSpeed lacks); finfo(fp32).min
    # is beyond bf16's largest finite value, so that mask becomes -inf too.
    assert out["bf16"] == (torch.bfloat16, torch.bfloat16, True)


def _unused(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out: dict[str, Any] = {}
    data = batches(1, 2 * 2 * world)
    for stage in (0, 2, 3):
        strict = config(stage=stage, zero_optimization={"stage": stage, "ignore_unused_parameters": False})
        engine, _, _, _ = rt.initialize(model=make_model(), config=strict)
        with pytest.raises(RuntimeError) as info:
            engine_run(engine, data, micro=2, gas=2)  # Net's `unused` Linear never gets a gradient
        out[f"strict{stage}"] = str(info.value)
        engine.destroy()
        model = make_model()
        model.unused.requires_grad_(False)  # frozen: no longer a trainable parameter without a gradient
        engine, _, _, _ = rt.initialize(model=model, config=strict)
        engine_run(engine, data, micro=2, gas=2)
        out[f"frozen{stage}"] = engine.global_steps
        engine.destroy()
    engine, _, _, _ = rt.initialize(model=make_model(), config=config(stage=2))  # default: true
    engine_run(engine, data, micro=2, gas=2)
    out["default"] = engine.global_steps
    engine.destroy()
    return out


def test_ignore_unused_parameters_false_raises_on_every_rank_naming_the_parameters() -> None:
    for out in run_distributed(_unused, world_size=2):
        for stage in (0, 2, 3):
            message = out[f"strict{stage}"]
            assert "ignore_unused_parameters is false" in message
            assert "'unused.weight'" in message and "'unused.bias'" in message
            assert out[f"frozen{stage}"] == 1
        assert out["default"] == 1


def _tags(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out = {}
    data = batches(1, 2 * 2 * world)
    for policy in ("Ignore", "Warn", "Fail"):
        cfg = config(stage=1, checkpoint={"tag_validation": policy})
        engine, _, _, _ = rt.initialize(model=make_model(), config=cfg)
        engine_run(engine, data, micro=2, gas=2)
        try:
            out[policy] = engine.save_checkpoint(Path(root) / policy, tag=f"tag{rank}")
        except ValueError as exc:
            out[policy] = str(exc)
        engine.destroy()
    return out


def test_checkpoint_tag_validation(tmp_path: Path) -> None:
    outs = run_distributed(_tags, world_size=2, args=(str(tmp_path),))
    for out in outs:
        # Ignore and Warn: one complete checkpoint under rank 0's tag (Warn also logs on rank 0).
        assert out["Ignore"] == str(tmp_path / "Ignore" / "tag0")
        assert out["Warn"] == str(tmp_path / "Warn" / "tag0")
        assert 'checkpoint.tag_validation is "Fail"' in out["Fail"] and "['tag0', 'tag1']" in out["Fail"]
    for policy in ("Ignore", "Warn"):
        assert sorted(p.name for p in (tmp_path / policy).iterdir()) == ["latest", "tag0"]
    assert not (tmp_path / "Fail").exists() or not any((tmp_path / "Fail").glob("tag*"))


def _buckets(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out = {}
    data = batches(3, 2 * 2 * world)
    cases = {
        "stage1_big": (1, 10**6, 10**6),
        "stage1_small_reduce": (1, 64, 10**6),
        "stage2_big": (2, 10**6, 10**6),
        "stage2_small_allgather": (2, 10**6, 64),
    }
    for name, (stage, reduce, gather) in cases.items():
        cfg = config(stage=stage)
        cfg["zero_optimization"].update(reduce_bucket_size=reduce, allgather_bucket_size=gather)
        engine, _, _, _ = rt.initialize(model=make_model(), config=cfg)
        trace = engine_run(engine, data, micro=2, gas=2)
        out[name] = (max(b.numel for gs in engine.stage.groups for b in gs.layout.buckets), trace.masters)
        engine.destroy()
    return out


def test_reduce_bucket_size_at_stage_1_and_allgather_bucket_size_at_stage_2() -> None:
    out = run_distributed(_buckets, world_size=2)[0]
    largest_param = 32 * 16  # fc1.weight: a parameter larger than the bucket gets a bucket of its own
    for big, small in (("stage1_big", "stage1_small_reduce"), ("stage2_big", "stage2_small_allgather")):
        assert out[big][0] > largest_param  # everything in one bucket
        assert out[small][0] == largest_param  # buckets of at most 64 elements, or one parameter
        for name, master in out[big][1].items():  # elementwise reductions and optimizer: identical weights
            assert torch.equal(master, out[small][1][name]), name


def _persistence(rank: int, world: int, cap: int | None) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 10**6}
    if cap is not None:
        zero["stage3_model_persistence_threshold"] = cap
    cfg = config(stage=3, zero_optimization=zero)
    model = make_tied()
    names = {id(p): n for n, p in model.named_parameters()}
    engine, _, _, _ = rt.initialize(model=model, config=cfg)
    persistent = sorted(
        names[id(gs.params[i])]
        for gs in engine.stage.sharded
        for b in gs.persistent
        for i in gs.layout.buckets[b].params
    )
    trace = engine_run(engine, token_batches(2, 2 * 2 * world), micro=2, gas=2)
    engine.destroy()
    return {"persistent": persistent, "masters": trace.masters}


def _deepspeed_choice(cap: int) -> list[str]:
    """DeepSpeed's mark_persistent_parameters over the trainable parameters, independently of ds_strategy."""
    chosen, total = [], 0
    for name, p in make_tied().named_parameters():
        if not p.requires_grad or name in chosen:
            continue
        if p.numel() + total <= cap:
            chosen.append(name)
            total += p.numel()
    return sorted(chosen)


def test_stage3_model_persistence_threshold_caps_the_persistent_total() -> None:
    uncapped = run_distributed(_persistence, world_size=2, args=(None,))[0]
    cap = 1200
    capped = run_distributed(_persistence, world_size=2, args=(cap,))[0]
    sizes = {n: p.numel() for n, p in make_tied().named_parameters()}
    assert sum(sizes[n] for n in uncapped["persistent"]) > cap  # without the cap every parameter persists
    assert capped["persistent"] == _deepspeed_choice(cap)
    assert 0 < sum(sizes[n] for n in capped["persistent"]) <= cap
    for name, master in uncapped["masters"].items():  # where a parameter lives does not change the math
        torch.testing.assert_close(master, capped["masters"][name], rtol=1e-6, atol=1e-7)


def _torch_adam(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out = {}
    data = batches(3, 2 * 2 * world)
    for name, torch_adam, offload in (("kernel", False, False), ("torch", True, False), ("offload", True, True)):
        cfg = config(stage=2, offload=offload)
        cfg["optimizer"]["params"]["torch_adam"] = torch_adam
        engine, opt, _, _ = rt.initialize(model=make_model(), config=cfg)
        trace = engine_run(engine, data, micro=2, gas=2)
        out[name] = (type(opt).__module__ + "." + type(opt).__name__, trace.masters)
        engine.destroy()
    return out


def test_torch_adam_selects_torch_optim_except_with_offload() -> None:
    out = run_distributed(_torch_adam, world_size=2)[0]
    assert out["kernel"][0] == "ds_strategy.ops.optimizers.CPUAdam"
    assert out["torch"][0] == "torch.optim.adamw.AdamW"
    assert out["offload"][0] == "ds_strategy.ops.optimizers.CPUAdam"  # DeepSpeed keeps CPU Adam with offload
    for name, master in out["kernel"][1].items():
        torch.testing.assert_close(out["torch"][1][name], master, rtol=1e-5, atol=1e-6)


class PeakNewMemory(TorchDispatchMode):
    """Peak bytes held by tensors that ops inside the mode allocate (an input's storage is not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = tree_flatten((args, kwargs or {}))[0]
        inputs = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if key in inputs or key in self._seen or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def _sub_groups(rank: int, world: int, precision: str, client: bool) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out = {}
    data = batches(3, 2 * 2 * world)
    for name, size in (("untiled", 10**9), ("tiled", 100)):
        cfg = config(stage=2, precision=precision, bucket=64, zero_optimization={"stage": 2, "sub_group_size": size})
        cfg["zero_optimization"].update(reduce_bucket_size=64, allgather_bucket_size=64)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True) if client else None
        engine, opt, _, _ = rt.initialize(model=model, optimizer=optimizer, config=cfg)
        seen: list[int] = []
        peaks: list[int] = []
        step = opt.step

        def spy(*args: Any, _opt: Any = opt, _step: Any = step, _log: Any = (seen, peaks), **kwargs: Any) -> Any:
            _log[0].append(sum(p.numel() for g in _opt.param_groups for p in g["params"] if p.grad is not None))
            with PeakNewMemory() as memory:
                result = _step(*args, **kwargs)
            _log[1].append(memory.peak)
            return result

        opt.step = spy  # type: ignore[method-assign]
        trace = engine_run(engine, data, micro=2, gas=2)
        largest = max(m.numel() for gs in engine.stage.groups for m in gs.masters)
        # the first of the 3 steps also creates the optimizer state: measure the later ones
        out[name] = (
            seen,
            largest,
            len(engine.stage.stepper.tiles()),
            trace.masters,
            trace.params,
            max(peaks[len(peaks) // 3 :]),
        )
        engine.destroy()
    return out


@pytest.mark.parametrize("precision,client", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_sub_group_size_tiles_the_optimizer_step(precision: str, client: bool) -> None:
    out = run_distributed(_sub_groups, world_size=2, args=(precision, client))[0]
    seen, largest, tiles, masters, params, peak = out["tiled"]
    full_seen, _, full_tiles, full_masters, full_params, full_peak = out["untiled"]
    assert full_tiles == 1 and tiles > 2
    assert len(seen) == 3 * tiles and len(full_seen) == 3
    # The bound: one optimizer call never sees more than sub_group_size elements (or one larger master).
    assert max(seen) <= max(100, largest) < max(full_seen)
    assert sum(seen) == sum(full_seen)  # every master stepped once per step
    if client:  # torch's foreach AdamW allocates temporaries for all the tensors it steps at once: measured
        assert 0 < peak <= 2 * 4 * max(100, largest), peak  # two fp32 temporaries per element of one tile
        assert peak < full_peak, (peak, full_peak)
    for name, master in full_masters.items():
        assert torch.equal(masters[name], master), name
        assert torch.equal(params[name], full_params[name]), name


def _averaging(rank: int, world: int) -> dict[str, float]:
    import ds_strategy.runtime as rt

    out = {}
    data = batches(1, 2 * 2 * world)
    cases = {
        "mean": {},
        "sum": {"gradient_allreduce_op": "sum"},
        "prescale": {"prescale_gradients": True},
        "predivide": {"gradient_predivide_factor": 4.0},
    }
    for name, extra in cases.items():
        engine, _, _, _ = rt.initialize(model=make_model(), config=config(stage=1, **extra))
        engine_run(engine, data, micro=2, gas=2)
        out[name] = float(engine.get_global_grad_norm())
        engine.destroy()
    return out


def test_gradient_averaging_keys() -> None:
    out = run_distributed(_averaging, world_size=2)[0]
    assert out["sum"] == pytest.approx(2 * out["mean"], rel=1e-6)  # "sum" keeps the sum over the 2 ranks
    assert out["prescale"] == pytest.approx(out["mean"], rel=1e-6)  # divided before instead of after
    assert out["predivide"] == pytest.approx(out["mean"], rel=1e-6)  # by 4 before, by 2 / 4 after


def _fp16_sum(rank: int, world: int) -> dict[int, list[bool]]:
    """Each rank's scaled fp16 gradient is 40000 (fits), the sum of two 80000 (does not)."""
    import ds_strategy.runtime as rt

    out = {}
    for stage in (0, 1, 2, 3):
        model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "fp16": {"enabled": True, "loss_scale": 40000},
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = rt.initialize(model=model, config=cfg)
        applied = []
        for _ in range(2):
            engine.backward(engine(torch.ones(1, 1, dtype=torch.half)).float().sum())
            engine.step()
            applied.append(engine.was_step_applied())
        out[stage] = applied
        engine.destroy()
    return out


def test_partitioned_stages_average_before_the_fp16_sum_as_deepspeed() -> None:
    """DeepSpeed's ZeRO 1-3 divide by the world size before the reduction (stage 0 sums first): a gradient
    whose scaled fp16 sum overflows while its mean does not steps at stages 1-3 and is skipped at stage 0."""
    out = run_distributed(_fp16_sum, world_size=2)[0]
    assert out == {0: [False, False], 1: [True, True], 2: [True, True], 3: [True, True]}, out


def _comm_dtypes(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out: dict[str, Any] = {}
    data = batches(4, 2 * 2 * world)
    for stage in (0, 2, 3):
        for precision, comm in (("fp32", None), ("bf16", None), ("fp16", None), ("bf16", "fp32")):
            extra = {} if comm is None else {"communication_data_type": comm}
            cfg = config(stage=stage, precision=precision, **extra)
            if comm is None:
                cfg.pop("communication_data_type", None)  # common.config pins fp32 for the references
            engine, _, _, _ = rt.initialize(model=make_model(), config=cfg)
            seen: set[torch.dtype] = set()
            for op in ("all_reduce", "reduce_scatter"):  # gradients: not the 2-long norm pair, not stage 3 int headers
                original = getattr(engine.coll, op)

                def record(
                    tensor: torch.Tensor, *args: Any, _original: Any = original, _seen: Any = seen, **kw: Any
                ) -> Any:
                    inputs = [tensor, *[a for a in args if isinstance(a, torch.Tensor)]]
                    _seen.update(t.dtype for t in inputs if t.numel() > 2 and t.is_floating_point())
                    return _original(tensor, *args, **kw)

                setattr(engine.coll, op, record)
            trace = engine_run(engine, data, micro=2, gas=2)
            out[f"{stage}-{precision}-{comm}"] = (sorted(str(d) for d in seen), trace.losses)
            engine.destroy()
    return out


def test_communication_data_type_defaults_to_the_compute_dtype_as_deepspeed() -> None:
    """Unset, gradients are reduced in the training dtype (DeepSpeed's engine default); "fp32" overrides."""
    out = run_distributed(_comm_dtypes, world_size=2)[0]
    for stage in (0, 2, 3):
        assert out[f"{stage}-fp32-None"][0] == ["torch.float32"], stage
        assert out[f"{stage}-bf16-None"][0] == ["torch.bfloat16"], stage
        assert out[f"{stage}-fp16-None"][0] == ["torch.float16"], stage
        assert out[f"{stage}-bf16-fp32"][0] == ["torch.float32"], stage
        # Reducing in bf16 rounds each sum once more: the run tracks the fp32-reduced one closely.
        torch.testing.assert_close(
            torch.tensor(out[f"{stage}-bf16-None"][1]), torch.tensor(out[f"{stage}-bf16-fp32"][1]), rtol=2e-2, atol=0
        )
