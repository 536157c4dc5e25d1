"""Every ZeRO stage, with and without offload, trains on one GPU like plain torch on that GPU.

World size 1 over NCCL (``init_process_group("nccl")``, rank 0 of 1, as ``torchrun --nproc-per-node 1``),
built by ``ds_strategy.initialize(model=..., optimizer=..., config=...)`` with a torch AdamW, 5 optimizer
steps of tests/runtime/common.py's MLP (2 micro-steps of 4 rows, two param groups, a frozen parameter
and a never-used Linear, buckets small enough that parameters span several). The reference is
tests/runtime/common.py's ``reference_run`` on the same GPU: torch AdamW on a plain module (fp32), or the
same 16-bit forward/backward per micro-step with fp32 masters (bf16/fp16).

At world size 1 the engine's collectives are local copies (the 2-process runs of test_gloo_two_processes.py
send CUDA tensors through a real backend); what this module proves is the CUDA path of everything else:
placement, flat buffers, stage 3's gather/free on the device, offload copies to and from pinned host
memory, the CUDA norm kernel, loss scaling, and (with the config's optimizer block) FusedAdam on the GPU
and CPUAdam on offloaded masters.

Tolerances: ``TOLERANCES`` in tests/cuda/common.py, which says why: fp32 rtol 1e-5 (losses, weights,
masters), bf16 / fp16 a few units of the 16-bit format (cuBLAS may pick other kernels for the engine's
flat-buffer views than for the reference's fresh tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests.cuda.common import (
    ON_GPU,
    assert_trains_like,
    destroy_process_group,
    device,
    engine_run,
    init_single_process_group,
    placement_errors,
    reference_on_device,
    requires_gpu,
)
from tests.runtime.common import batches, config, groups_of, make_model

pytestmark = [requires_gpu, pytest.mark.kernels]

STEPS, MICRO, GAS, LR = 5, 4, 2, 1e-2
# (stage, offload_optimizer, offload_param)
LAYOUTS = [(0, False, False), (1, False, False), (1, True, False), (2, False, False), (2, True, False),
           (3, False, False), (3, True, False), (3, True, True)]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    init_single_process_group()
    yield
    destroy_process_group()


def zero_config(
    stage: int, precision: str, offload_optimizer: bool, offload_param: bool, client_optimizer: bool = True
) -> dict[str, Any]:
    """tests/runtime/common.py's config; ``client_optimizer``: without its optimizer block (a torch AdamW is
    passed in), else with it (AdamW built by the engine: FusedAdam on the GPU, CPUAdam when offloaded)."""
    cfg = config(stage=stage, precision=precision, offload=offload_optimizer, micro=MICRO, gas=GAS, lr=LR, clip=0.5)
    zero = cfg["zero_optimization"]
    if client_optimizer:
        del cfg["optimizer"]
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if client_optimizer:
            cfg["zero_force_ds_cpu_optimizer"] = False  # a torch AdamW stepping the host masters
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every bucket gathered and freed per module
        zero["offload_param"] = {"device": "cpu" if offload_param else "none", "pin_memory": True}
    return cfg


def _train(
    stage: int, precision: str, offload_optimizer: bool, offload_param: bool, client_optimizer: bool = True
) -> tuple[dict, dict, Any]:
    import ds_strategy

    data = batches(STEPS, MICRO * GAS)
    model = make_model()
    cfg = zero_config(stage, precision, offload_optimizer, offload_param, client_optimizer)
    if client_optimizer:
        optimizer = torch.optim.AdamW(groups_of(model), lr=LR)
        engine, opt, _, _ = ds_strategy.initialize(model=model, optimizer=optimizer, config=cfg)
    else:
        engine, opt, _, _ = ds_strategy.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    assert engine.device == device(), engine.device
    assert opt is not None
    got = engine_run(engine, data, micro=MICRO, gas=GAS)
    ref = reference_on_device(
        data,
        precision=precision,
        micro=MICRO,
        world=1,
        gas=GAS,
        lr=LR,
        clip=0.5,
        loss_scale=2.0**8 if precision == "fp16" else 1.0,
    )
    return got, ref, engine


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    ("stage", "offload_optimizer", "offload_param"),
    LAYOUTS,
    ids=[f"stage{s}{'-offload' if o else ''}{'-param' if p else ''}" for s, o, p in LAYOUTS],
)
def test_stage_trains_like_torch_on_the_gpu(
    stage: int, offload_optimizer: bool, offload_param: bool, precision: str
) -> None:
    label = f"stage {stage} offload_optimizer={offload_optimizer} offload_param={offload_param} {precision}"
    got, ref, engine = _train(stage, precision, offload_optimizer, offload_param)
    try:
        assert_trains_like(got, ref, precision, label, clip=0.5)
        assert got["gathered_on_device"], f"{label}: GatheredParameters handed back host tensors"
        errors = placement_errors(
            engine, offload_optimizer=offload_optimizer, offload_param=offload_param, pin_memory=True
        )
        assert not errors, f"{label}: tensors in the wrong memory:\n" + "\n".join(errors)
    finally:
        engine.destroy()


CONFIG_LAYOUTS = [(1, False, False), (2, False, False), (2, True, False), (3, False, False), (3, True, True)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("stage", "offload_optimizer", "offload_param"),
    CONFIG_LAYOUTS,
    ids=[f"stage{s}{'-offload' if o else ''}{'-param' if p else ''}" for s, o, p in CONFIG_LAYOUTS],
)
def test_the_configs_optimizer_trains_like_torch_adamw(
    stage: int, offload_optimizer: bool, offload_param: bool, precision: str
) -> None:
    """The user's usual path: ``"optimizer": {"type": "AdamW"}`` in the config, which the engine builds as
    the CUDA FusedAdam (masters on the GPU) or the CPU kernels' CPUAdam (offloaded masters), stepped in the
    engine's fused optimizer pass; the same comparison with torch's AdamW."""
    label = f"config AdamW: stage {stage} offload={offload_optimizer}/{offload_param} {precision}"
    got, ref, engine = _train(stage, precision, offload_optimizer, offload_param, client_optimizer=False)
    try:
        expected = "CPUAdam" if offload_optimizer or not ON_GPU else "FusedAdam"
        assert type(engine.optimizer).__name__ == expected, f"{label}: {type(engine.optimizer).__name__}"
        assert_trains_like(got, ref, precision, label, clip=0.5)
        errors = placement_errors(
            engine, offload_optimizer=offload_optimizer, offload_param=offload_param, pin_memory=True
        )
        assert not errors, f"{label}: tensors in the wrong memory:\n" + "\n".join(errors)
    finally:
        engine.destroy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partial_offload_trains_like_torch_with_a_share_on_each_side(stage: int, precision: str) -> None:
    """``offload_optimizer.ratio`` 0.3 (issue 46): about a third of the masters and Adam state on the host, stepped
    by CPUAdam, the rest on the GPU, stepped there in the same pass; the same comparison with torch's AdamW.
    The split falls between buckets (runtime/zero/partial_offload.py), so the share is the nearest the small
    buckets of this model allow."""
    import ds_strategy

    label = f"partial offload 0.3: stage {stage} {precision}"
    data = batches(STEPS, MICRO * GAS)
    model = make_model()
    cfg = zero_config(stage, precision, True, False, client_optimizer=False)
    cfg["zero_optimization"]["offload_optimizer"]["ratio"] = 0.3
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    try:
        split = engine.memory_breakdown(by_device=True)
        assert split["master"] > 0 and split["master_host"] > 0, f"{label}: {split}"
        got = engine_run(engine, data, micro=MICRO, gas=GAS)
        ref = reference_on_device(data, precision=precision, micro=MICRO, world=1, gas=GAS, lr=LR, clip=0.5)
        assert_trains_like(got, ref, precision, label, clip=0.5)
    finally:
        engine.destroy()


NVME_LAYOUTS = [(1, False), (2, False), (3, False), (3, True)]  # (stage, parameters on NVMe too)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    ("stage", "params"), NVME_LAYOUTS, ids=[f"stage{s}{'-param' if p else ''}" for s, p in NVME_LAYOUTS]
)
def test_nvme_offload_trains_like_torch_on_the_gpu(stage: int, params: bool, precision: str, tmp_path: Any) -> None:
    """NVMe offload (issue 22) on the GPU: masters, optimizer state, stage 3's gradients (and partitions)
    in swap files, moved between the device and the files through host memory, several sub-groups."""
    import ds_strategy

    label = f"nvme stage {stage} params={params} {precision}"
    data = batches(STEPS, MICRO * GAS)
    model = make_model()
    cfg = zero_config(stage, precision, True, params, client_optimizer=False)
    zero = cfg["zero_optimization"]
    zero["sub_group_size"] = 300
    zero["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": str(tmp_path),
        "buffer_count": 8,  # two Adam sub-groups: the pipeline overlaps (pinned buffers, kept between steps)
        "pipeline_read": True,
        "pipeline_write": True,
    }
    if params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_size": 1000}
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    try:
        got = engine_run(engine, data, micro=MICRO, gas=GAS)
        ref = reference_on_device(
            data, precision=precision, micro=MICRO, world=1, gas=GAS, lr=LR, clip=0.5,
            loss_scale=2.0**8 if precision == "fp16" else 1.0,
        )  # fmt: skip
        assert_trains_like(got, ref, precision, label, clip=0.5)
        assert all(m.numel() == 0 for gs in engine.stage.groups for m in gs.masters), f"{label}: masters in memory"
    finally:
        engine.destroy()
    assert not any((tmp_path / "ds_strategy_swap").iterdir()), f"{label}: swap files left behind"


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))) * self.scale, y)


@pytest.mark.parametrize("offload_param", [False, True], ids=["device", "offload_param"])
def test_zero_init_and_gathered_parameters_on_the_gpu(offload_param: bool) -> None:
    """A model built under ``zero.Init()`` is partitioned on the GPU; ``GatheredParameters`` reads it whole
    and keeps rank 0's edit; stage 3 trains it like torch trains the same (edited) model on the GPU."""
    import ds_strategy
    from ds_strategy.zero import GatheredParameters, Init

    dev = device()
    torch.manual_seed(0)
    plain = Small()
    torch.manual_seed(0)
    with Init():
        model = Small()
    for name, p in model.named_parameters():
        assert p.numel() == 0, f"{name} is whole after zero.Init: {tuple(p.shape)}"
    with GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert p.device == dev, f"{name} gathered on {p.device}"
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=0, atol=0, msg=name)
    with GatheredParameters([model.scale], modifier_rank=0):
        model.scale.data.mul_(2)
    with torch.no_grad():
        plain.scale.mul_(2)
    cfg = zero_config(3, "fp32", offload_param, offload_param)
    cfg["gradient_accumulation_steps"] = 1
    cfg["gradient_clipping"] = 0.0
    engine, *_ = ds_strategy.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), config=cfg
    )
    reference = plain.to(dev)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.1)
    try:
        for x, y in batches(3, MICRO, seed=3):
            x, y = x.to(dev), y.to(dev)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            ref_loss = reference(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        with GatheredParameters(list(model.parameters())):
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                assert p.device == dev, f"{name} gathered on {p.device}"
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        errors = placement_errors(engine, offload_optimizer=offload_param, offload_param=offload_param, pin_memory=True)
        assert not errors, "\n".join(errors)
    finally:
        engine.destroy()
