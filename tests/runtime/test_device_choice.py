"""Which device the engine trains on (issue 17: the caller's device wins; LOCAL_RANK is not a GPU index).

No GPU here: CUDA is faked at the level the code asks (is_available, current_device, the accelerator's
set_device), and modules without tensors make ``module.to("cuda:3")`` a no-op."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ds_strategy.comm.distributed as distributed
from ds_strategy.runtime.engine import _place


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, current: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_cpu_built_module_goes_to_the_current_cuda_device_not_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, current=3)
    monkeypatch.setenv("LOCAL_RANK", "0")  # Trainer(devices=[2, 3]) / CUDA_VISIBLE_DEVICES: not the GPU index
    assert _place(nn.Identity()) == torch.device("cuda", 3)


def test_the_callers_device_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, current=0)
    assert _place(nn.Identity(), "cuda:2") == torch.device("cuda", 2)
    assert _place(nn.Linear(2, 2), "cpu").type == "cpu"


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def device_count(self) -> int:
        return 8

    def set_device(self, index: int) -> None:
        self.calls.append(index)


@pytest.mark.parametrize(("device_type", "expected"), [("cuda", [1]), ("none", [])])
def test_init_distributed_sets_local_rank_device_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, device_type: str, expected: list[int]
) -> None:
    """set_device=False (what ZeroStrategy passes) reaches _finish as device type "none": no set_device."""
    recorder = _Recorder()
    monkeypatch.setattr(distributed, "get_accelerator", lambda *a: recorder)
    monkeypatch.setattr(distributed, "destroy_at_normal_exit", lambda: None)
    info: Any = distributed.DistributedInfo(rank=1, world_size=2, local_rank=1, backend="nccl", source="env")
    distributed._finish(info, device_type)
    assert recorder.calls == expected


def test_strategy_builds_the_engine_on_its_root_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_strategy.runtime as runtime
    from ds_strategy.lightning.strategy import ZeroStrategy

    seen: dict[str, Any] = {}
    monkeypatch.setattr(runtime, "ZeroEngine", lambda *a, **kw: seen.update(kw))
    strategy = ZeroStrategy(stage=2)
    monkeypatch.setattr(ZeroStrategy, "root_device", property(lambda self: torch.device("cuda", 3)))
    # setup() builds through the core shared with the Fabric strategy, handing it the root device.
    strategy.core.build_engine(nn.Identity(), None, None, strategy.root_device)  # type: ignore[arg-type]
    assert seen["device"] == torch.device("cuda", 3)


@pytest.mark.parametrize(
    ("device", "pin", "target", "expected"),
    [
        ("cuda", True, "cpu", True),
        ("cuda", False, "cpu", False),  # the key is read: false means pageable host buffers
        ("cuda", True, "none", False),  # nothing offloaded
        ("cpu", True, "cpu", False),  # pinning means nothing when the compute device is the CPU
    ],
)
def test_offload_pin_memory_key_decides_pinning(device: str, pin: bool, target: str, expected: bool) -> None:
    from ds_strategy.config import load_config
    from ds_strategy.runtime.zero.offload import Offload
    from ds_strategy.runtime.zero.stage3 import Stage3Options

    zero = {"stage": 3, "offload_optimizer": {"device": target, "pin_memory": pin}}
    zero["offload_param"] = {"device": target, "pin_memory": pin}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=1)
    offload = Offload.from_config(cfg.zero_optimization)
    assert offload.pin_masters(torch.device(device)) is expected
    # Parameter offload's own key (parameter-only offload is pinned too); the stage adds the CUDA condition.
    assert Stage3Options.from_config(cfg, offload).param_pin is (pin and target == "cpu")
