"""ds_strategy.checkpointing's API as DeepSpeed has it (issue 20, criterion 1): configure from a config
block or arguments, random-state replay, the model-parallel tracker, partitioned / host / contiguous
inputs (each equal to the plain checkpoint), the one-time messages, the policy that checkpoints in place."""

from __future__ import annotations

import copy
import io
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ds_strategy import checkpointing
from ds_strategy.runtime.activation_checkpointing import options as ac_settings
from tests.harness import run_distributed


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    ac_settings.unconfigure()
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    ac_settings.unconfigure()
    checkpointing.get_cuda_rng_tracker().reset()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 6))


def _grads(run: Any, net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    net.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(7)
    out = run(net, x)
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("fn", ["checkpoint", "non_reentrant_checkpoint"])
def test_dropout_draws_the_same_masks_in_the_recomputation(fn: str) -> None:
    net, x = _net(), torch.randn(5, 6)
    run = getattr(checkpointing, fn)
    out, grads = _grads(run, net, x)
    ref_out, ref_grads = _grads(lambda m, t: m(t), net, x)
    assert torch.equal(out, ref_out)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a, b)
    after = torch.rand(1)  # backward left the caller's stream where the forward left it
    torch.manual_seed(7)
    net(x)
    assert torch.equal(after, torch.rand(1))


def test_configure_reads_the_block_then_the_arguments() -> None:
    assert not checkpointing.is_configured()
    block = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": 4}
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {**block, "profile": True}})
    s = ac_settings.settings()
    assert checkpointing.is_configured()
    assert (s.partition_activations, s.contiguous_checkpointing, s.num_checkpoints, s.profile) == (True, True, 4, True)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": block}, profile=False, synchronize=True)
    s = ac_settings.settings()
    assert (s.profile, s.synchronize, s.num_checkpoints) == (False, True, 4)


def test_contiguous_needs_partitioning_and_a_count() -> None:
    with pytest.raises(ValueError, match="needs partition_activations: true"):
        checkpointing.configure(contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="needs number_checkpoints"):
        checkpointing.configure(partition_activations=True, contiguous_checkpointing=True)


def _init_body(rank: int, world: int) -> tuple[bool, bool]:
    import ds_strategy
    from ds_strategy.runtime.activation_checkpointing import options as s

    s.unconfigure()
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "activation_checkpointing": {"synchronize_checkpoint_boundary": True, "profile": True},
    }
    engine, *_ = ds_strategy.initialize(model=nn.Linear(2, 2), config=cfg)
    engine.destroy()
    return s.is_configured(), s.settings().synchronize and s.settings().profile


@pytest.mark.multiprocess
def test_initialize_configures_from_the_config_block() -> None:
    assert run_distributed(_init_body, world_size=1) == [(True, True)]


def test_messages_for_options_without_meaning_here(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ds_strategy")
    checkpointing.configure(partition_activations=True, checkpoint_in_cpu=True, synchronize=True)
    net, x = _net(), torch.randn(3, 6, requires_grad=True)
    for _ in range(2):
        checkpointing.checkpoint(net, x).sum().backward()
    text = [r.getMessage() for r in caplog.records]
    assert sum("partition_activations splits" in t for t in text) == 1, text
    assert sum("cpu_checkpointing moves checkpoint inputs to host memory" in t for t in text) == 1, text
    assert sum("synchronize_checkpoint_boundary waits" in t for t in text) == 1, text


def test_profile_reports_forwards_and_recomputations() -> None:
    checkpointing.configure(profile=True)
    checkpointing.profile_report()
    net, x = _net(), torch.randn(3, 6, requires_grad=True)
    checkpointing.checkpoint(net, x).sum().backward()
    checkpointing.non_reentrant_checkpoint(net, x).sum().backward()
    report = checkpointing.profile_report()
    assert report["calls"] == 2 and report["forward_ms"] > 0 and report["recompute_ms"] > 0


def test_reentrant_refuses_autograd_grad_non_reentrant_supports_it() -> None:
    net, x = _net(), torch.randn(3, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"not torch\.autograd\.grad"):
        torch.autograd.grad(checkpointing.checkpoint(net, x).sum(), x)
    (g,) = torch.autograd.grad(checkpointing.non_reentrant_checkpoint(net.eval(), x).sum(), x)
    (ref,) = torch.autograd.grad(net(x).sum(), x)
    assert torch.equal(g, ref)


def test_the_tracker_forks_a_named_stream() -> None:
    checkpointing.model_parallel_cuda_manual_seed(123)
    tracker = checkpointing.get_cuda_rng_tracker()
    default_next = torch.rand(3)
    checkpointing.model_parallel_cuda_manual_seed(123)
    with tracker.fork():
        forked = torch.rand(3)
    assert torch.equal(torch.rand(3), default_next)  # the default stream did not move
    assert not torch.equal(forked, default_next)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 5)
    with pytest.raises(KeyError, match="not in the tracker"), tracker.fork("other"):
        pass


def test_dropout_in_a_forked_region_replays_in_the_recomputation() -> None:
    checkpointing.model_parallel_cuda_manual_seed(5)
    drop = nn.Dropout(0.5)

    def fn(t: torch.Tensor) -> torch.Tensor:
        with checkpointing.get_cuda_rng_tracker().fork():
            return drop(t) * 2

    x = torch.randn(4, 4, requires_grad=True)
    states = checkpointing.get_cuda_rng_tracker().get_states()
    checkpointing.checkpoint(fn, x).sum().backward()
    checkpointing.get_cuda_rng_tracker().set_states(states)
    x2 = x.detach().clone().requires_grad_(True)
    fn(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


class _Mpu:
    """Megatron's mpu over the whole world: every rank is one model-parallel group."""

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size()

    def get_model_parallel_group(self) -> Any:
        return torch.distributed.group.WORLD

    def get_data_parallel_group(self) -> Any:
        return torch.distributed.new_group([torch.distributed.get_rank()])


def _partitioned(rank: int, world: int, reentrant: bool) -> dict[str, Any]:
    from ds_strategy import checkpointing as ck
    from ds_strategy.runtime.activation_checkpointing import options as s
    from ds_strategy.runtime.activation_checkpointing.stash import BUFFERS

    net, x = _net(), torch.randn(5, 7, 6)  # 210 elements: not a multiple of the world (padding)
    run = ck.checkpoint if reentrant else ck.non_reentrant_checkpoint
    out = {}
    for name, kw in {
        "plain": {},
        "partitioned": {"partition_activations": True},
        "contiguous": {"partition_activations": True, "contiguous_checkpointing": True, "num_checkpoints": 2},
    }.items():
        s.unconfigure()
        ck.configure(_Mpu(), **kw)
        ck.reset()
        _, grads = _grads(lambda m, t: run(m, run(m, t)), net, x)
        out[name] = grads
        out[name + "_buffers"] = len(BUFFERS._buffers)
    s.unconfigure()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_partitioned_and_contiguous_inputs_train_like_plain(reentrant: bool) -> None:
    for r in run_distributed(_partitioned, world_size=2, args=(reentrant,), timeout=120):
        for mode in ("partitioned", "contiguous"):
            for a, b in zip(r[mode], r["plain"], strict=True):
                assert torch.equal(a, b), mode
        assert r["contiguous_buffers"] == 2  # one per checkpointed call, reused


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.fc(x))


def test_the_policy_checkpoints_in_place_keeping_names() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Blk(), nn.Sequential(Blk(), nn.ReLU()), nn.Linear(4, 1))
    before = list(model.state_dict())
    picked = checkpointing.apply_activation_checkpointing(model, {Blk})
    assert picked == ["0", "1.0"]
    assert list(model.state_dict()) == before and isinstance(model[0], Blk)
    assert checkpointing.is_checkpointed(model[0]) and not checkpointing.is_checkpointed(model[2])
    assert checkpointing.apply_activation_checkpointing(model, {Blk}) == []  # idempotent
    model(torch.randn(2, 4)).sum().backward()
    assert model[0].calls == 2  # forward, then the recomputation in backward
    buf = io.BytesIO()
    torch.save(model, buf)  # the run-time subclass pickles by its original class
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert checkpointing.is_checkpointed(loaded[0]) and type(loaded[0]) is type(model[0])
    assert checkpointing.is_checkpointed(copy.deepcopy(model)[1][0])
    calls = []
    checkpointing.apply_activation_checkpointing(
        nn.Sequential(nn.Linear(2, 2)), lambda module, recurse, nonwrapped_numel: calls.append(recurse) or False
    )
    assert calls == [False]
    with pytest.raises(TypeError, match="activation_checkpointing_policy must be"):
        checkpointing.apply_activation_checkpointing(model, {"Blk"})  # type: ignore[arg-type]
