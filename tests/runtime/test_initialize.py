"""ds_strategy's initialize(): config or client optimizer/scheduler, the distributed loader, the ZeRO rules."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from tests.harness import run_distributed
from tests.runtime.common import batches, config, groups_of, make_model, micro_slice


def _cfg(stage: int, **extra: Any) -> dict[str, Any]:
    cfg = config(stage=stage, micro=2, gas=1)
    cfg.update(extra)
    return cfg


def _initialize_cases(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    out: dict[str, Any] = {}
    data = batches(6, 2 * world)

    # Config optimizer + config scheduler.
    cfg = _cfg(
        1,
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_type": "linear", "warmup_max_lr": 0.04},
        },
    )
    engine, opt, loader, sched = rt.initialize(model=make_model(), config=cfg)
    lrs = []
    for batch in data[:3]:
        lrs.append(engine.get_lr()[0])
        engine.backward(engine(*micro_slice(batch, 2, world, 0, rank)))
        engine.step()
    out["config_built"] = (type(opt).__name__, type(sched).__name__, loader, opt is engine.optimizer, lrs)
    engine.destroy()

    # Every optimizer type the config can name trains.
    kinds = {}
    for kind in ("Adam", "AdamW", "Adagrad", "Lion", "SGD"):
        cfg = _cfg(2, optimizer={"type": kind, "params": {"lr": 1e-2}})
        engine, opt, _, _ = rt.initialize(model=make_model(), config=cfg)
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(*micro_slice(data[0], 2, world, 0, rank)))
        engine.step()
        moved = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
        kinds[kind] = (type(opt).__name__, moved)
        engine.destroy()
    out["kinds"] = kinds

    # Client optimizer (SGD, momentum, two groups) + client torch scheduler == single-process torch.
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(groups_of(model, 0.01), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    engine, got_opt, _, got_sched = rt.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=_cfg(2))
    ref_opt = torch.optim.SGD(groups_of(ref, 0.01), lr=0.05, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for batch in data:
        engine.backward(engine(*micro_slice(batch, 2, world, 0, rank)))
        engine.step()
        ref(*batch).backward()
        for p in ref.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    out["client"] = (got_opt is opt, got_sched is sched, diff, engine.get_lr(), ref_sched.get_last_lr())
    engine.destroy()

    # A callable optimizer and a callable scheduler.
    engine, opt, _, sched = rt.initialize(
        model=make_model(),
        config=_cfg(1),
        optimizer=lambda groups: torch.optim.Adam(groups, lr=1e-3),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)),
    )
    # one flat fp32 master per bucket of the group (200-element buckets here)
    buckets = len(engine.stage.groups[0].layout.buckets)
    out["callables"] = (type(opt).__name__, type(sched).__name__, len(opt.param_groups[0]["params"]) == buckets > 1)
    engine.destroy()

    # training_data -> a DistributedSampler loader of micro batches, disjoint across ranks.
    dataset = TensorDataset(torch.arange(20).float().unsqueeze(1))
    engine, _, loader, _ = rt.initialize(model=make_model(), config=_cfg(0), training_data=dataset)
    seen = torch.cat([b[0].flatten() for b in loader])
    out["loader"] = ([len(b[0]) for b in loader], seen, engine.training_dataloader is loader)
    engine.destroy()

    # The ZeRO rules.
    errors = {}
    for name, kwargs in {
        "untested": {"optimizer": lambda g: torch.optim.RMSprop(g, lr=1e-3), "config": _cfg(1)},
        "offload_client": {
            "optimizer": lambda g: torch.optim.SGD(g, lr=1e-3),
            "config": config(stage=2, micro=2, gas=1, offload=True),
        },
        "both_configs": {"config": _cfg(0), "config_params": _cfg(0)},
        "args_and_config": {"args": types.SimpleNamespace(deepspeed_config="ds.json"), "config": _cfg(0)},
    }.items():
        try:
            rt.initialize(model=make_model(), **kwargs).__getitem__(0).destroy()
        except ValueError as exc:
            errors[name] = str(exc)
    model = make_model()
    stateful = torch.optim.Adam(model.parameters())
    stateful.state[next(iter(stateful.param_groups[0]["params"]))]["step"] = torch.tensor(1.0)
    try:
        rt.initialize(model=model, optimizer=stateful, config=_cfg(0))
    except ValueError as exc:
        errors["stateful"] = str(exc)
    # Optimizer offload with a client torch AdamW: stepped by its C++ twin over the same group dicts, so
    # the client's scheduler still drives the lr, and it trains like the config-built CPUAdam.
    twins = {}
    for kind in ("AdamW", "Adam"):
        model = make_model()
        client = getattr(torch.optim, kind)(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
        engine, opt, _, _ = rt.initialize(
            model=model, optimizer=client, lr_scheduler=sched, config=config(stage=2, micro=2, gas=1, offload=True)
        )
        engine.backward(engine(*micro_slice(data[0], 2, world, 0, rank)))
        engine.step()
        twins[kind] = (type(opt).__name__, opt.param_groups is client.param_groups, opt.param_groups[0]["lr"])
        twins[kind] += (opt.param_groups[0]["adamw_mode"],)
        engine.destroy()
    out["twins"] = twins
    allowed = _cfg(1, zero_allow_untested_optimizer=True)
    engine, opt, _, _ = rt.initialize(
        model=make_model(), config=allowed, optimizer=lambda g: torch.optim.RMSprop(g, lr=1e-3)
    )
    errors["allowed"] = type(opt).__name__
    engine.destroy()
    out["errors"] = errors
    return out


@pytest.mark.multiprocess
def test_initialize() -> None:
    outs = run_distributed(_initialize_cases, world_size=2)
    for out in outs:
        name, sched_name, loader, same, lrs = out["config_built"]
        assert (name, sched_name, loader, same) == ("CPUAdam", "WarmupLR", None, True)  # the C++ kernel on CPU
        # DeepSpeed's WarmupLR: min lr at construction, and the first step() lands on iteration 0 (min again)
        assert lrs == pytest.approx([0.0, 0.0, 0.01])
        assert out["kinds"] == {  # CPU masters: the C++ kernels where ds_strategy has one
            "Adam": ("CPUAdam", True),
            "AdamW": ("CPUAdam", True),
            "Adagrad": ("CPUAdagrad", True),
            "Lion": ("CPULion", True),
            "SGD": ("SGD", True),
        }
        same_opt, same_sched, diff, lr, ref_lr = out["client"]
        assert same_opt and same_sched and lr == ref_lr
        assert diff < 1e-6
        assert out["callables"] == ("Adam", "LambdaLR", True)
        errors = out["errors"]
        assert "RMSprop is untested" in errors["untested"] and "zero_allow_untested_optimizer" in errors["untested"]
        assert "zero_force_ds_cpu_optimizer" in errors["offload_client"]
        assert out["twins"] == {"AdamW": ("CPUAdam", True, 5e-3, True), "Adam": ("CPUAdam", True, 5e-3, False)}
        assert "config= or config_params=" in errors["both_configs"]
        assert "args.deepspeed_config='ds.json' and config=" in errors["args_and_config"]
        assert "already holds state" in errors["stateful"]
        assert errors["allowed"] == "RMSprop"
    sizes0, seen0, attached = outs[0]["loader"]
    sizes1, seen1, _ = outs[1]["loader"]
    assert attached and sizes0 == sizes1 == [2] * 5
    assert sorted(torch.cat([seen0, seen1]).tolist()) == list(range(20))


def _env_init(rank: int, world: int) -> tuple[bool, int, float]:
    """No process group yet, RANK/WORLD_SIZE/MASTER_* in the environment: initialize() uses env://."""
    import ds_strategy.runtime as rt

    engine, _, _, _ = rt.initialize(model=make_model(), config=_cfg(2))
    result = (dist.is_initialized(), dist.get_world_size(), engine.train_batch_size())
    engine.destroy()
    return result


@pytest.mark.multiprocess
def test_initialize_sets_up_torch_distributed_from_the_environment() -> None:
    assert run_distributed(_env_init, world_size=2, init_process_group=False) == [(True, 2, 4)] * 2


def test_initialize_alone_in_a_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher at all: a single-process group, and training equals plain PyTorch."""
    import ds_strategy.runtime as rt

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_process_group wraps it (tests/leak_police.py)
    assert not dist.is_initialized()
    try:
        model = make_model()
        ref = copy.deepcopy(model)
        engine, _, _, _ = rt.initialize(model=model, config=_cfg(1, gradient_clipping=0.5))
        assert dist.get_world_size() == 1
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for batch in batches(3, 2):
            engine.backward(engine(*batch))
            engine.step()
            ref(*batch).backward()
            for p in ref.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # DeepSpeed's config queries answer from the config.
        assert (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.gradient_clipping()) == (False, False, 0.5)
        assert engine.zero_optimization() == (engine.zero_optimization_stage() > 0)
        assert engine.get_mom() == [g["betas"] for g in engine.optimizer.param_groups]
        engine.destroy()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
