"""No host synchronisation in a training step, on the GPU (issue 41, criterion 3; docs/zero3.md, "No host
synchronisation in a step").

World size 1 over NCCL, as tests/cuda/test_engine_single_gpu.py. The first optimizer step runs plainly
(stage 3 records its gather order); steps 2..N - forward, backward, gradient clipping, the optimizer step,
zero_grad - run under ``torch.cuda.set_sync_debug_mode("error")``, where any synchronising CUDA call (a
``.item()``, a blocking copy to or from pageable host memory, ``torch.cuda.synchronize`` ...) raises. The
inputs are on the device before the mode starts; nothing is read until it ends (the losses and gradient norms
are kept as device tensors, the norm through ``engine._global_grad_norm``, which the engine keeps on the
device until ``get_global_grad_norm()`` is asked). After the mode the run is compared with the torch
reference (tests/cuda/common.py's tolerances), so the sync-free step is also the right step.

fp16 keeps exactly one read per optimizer step (the loss scaler's skip decision): counted with
``set_sync_debug_mode("warn")``, one warning per step.

In a CPU rehearsal (``DS_STRATEGY_CUDA_REHEARSAL=1``) the device-strict mode stands in: the engine brackets
the same steps with ``strict.no_host_reads`` and every host read of device memory raises there instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.cuda.common import (
    ON_GPU,
    assert_trains_like,
    destroy_process_group,
    device,
    full_masters,
    init_single_process_group,
    reference_on_device,
    requires_gpu,
)
from tests.runtime.common import batches, config, groups_of, make_model, micro_slice

pytestmark = [requires_gpu]

STEPS, MICRO, GAS, LR, CLIP = 5, 4, 2, 1e-2, 0.5


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    init_single_process_group()
    yield
    destroy_process_group()


@contextlib.contextmanager
def sync_debug(mode: str) -> Iterator[list[str]]:
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block (nothing in a rehearsal); yields the texts of
    the synchronisation warnings seen ("warn")."""
    seen: list[str] = []
    if not ON_GPU:
        yield seen
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode(0)
    seen.extend(str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message))


def _engine(stage: int, precision: str, optimizer: str) -> Any:
    import ds_strategy

    cfg = config(stage=stage, precision=precision, micro=MICRO, gas=GAS, lr=LR, clip=CLIP, bucket=200)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every bucket gathered and freed
    model = make_model()
    if optimizer == "config":  # the config's AdamW: FusedAdam on the GPU
        engine, *_ = ds_strategy.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    else:  # torch's AdamW with fused=True: skips a non-finite step on the device (found_inf)
        del cfg["optimizer"]
        opt = torch.optim.AdamW(groups_of(model), lr=LR, fused=True)
        engine, *_ = ds_strategy.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _run(stage: int, precision: str, optimizer: str, mode: str) -> tuple[dict[str, Any], list[str]]:
    """Train ``STEPS`` optimizer steps, steps 2..N under ``sync_debug(mode)``; the engine_run-shaped result
    (tests/cuda/common.py) and the synchronisation warnings seen."""
    from ds_strategy.zero import GatheredParameters

    engine = _engine(stage, precision, optimizer)
    dev = engine.device
    assert dev == device(), dev
    data = batches(STEPS, MICRO * GAS)
    on_dev = [[tuple(t.to(dev) for t in micro_slice(batch, MICRO, 1, m, 0)) for m in range(GAS)] for batch in data]
    losses: list[torch.Tensor] = []
    norms: list[Any] = []

    def step(micro_batches: list[tuple[torch.Tensor, ...]]) -> None:
        total = torch.zeros((), device=dev)
        for x, y in micro_batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        losses.append(total / GAS)
        norms.append(engine._global_grad_norm)  # a device tensor (fp16: a host number), read below

    try:
        step(on_dev[0])  # records stage 3's order: may synchronise
        with sync_debug(mode) as seen:
            for micro_batches in on_dev[1:]:
                step(micro_batches)
            engine.zero_grad()
        with GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
        got = {
            "losses": [float(v) for v in losses],
            "norms": [float(v) for v in norms],
            "params": params,
            "masters": full_masters(engine),
            "skipped": engine.skipped_steps,
        }
    finally:
        engine.destroy()
    return got, seen


def _reference(precision: str) -> dict[str, Any]:
    return reference_on_device(
        batches(STEPS, MICRO * GAS), precision=precision, micro=MICRO, world=1, gas=GAS, lr=LR, clip=CLIP,
        loss_scale=2.0**8 if precision == "fp16" else 1.0,
    )  # fmt: skip


CASES = [(3, "bf16", "config"), (3, "bf16", "torch-fused"), (3, "fp32", "config"), (2, "bf16", "config"),
         (1, "bf16", "torch-fused")]  # fmt: skip


@pytest.mark.parametrize(("stage", "precision", "optimizer"), CASES, ids=[f"stage{s}-{p}-{o}" for s, p, o in CASES])
def test_steps_after_the_first_never_synchronise(stage: int, precision: str, optimizer: str) -> None:
    label = f"stage {stage} {precision} {optimizer}"
    got, seen = _run(stage, precision, optimizer, "error")  # a synchronisation raises inside
    assert not seen, f"{label}: {seen}"
    assert_trains_like(got, _reference(precision), precision, label, clip=CLIP)


def test_fp16_keeps_one_synchronisation_per_optimizer_step() -> None:
    """The loss scaler must know on the host whether the step overflowed: exactly one read per optimizer
    step (runtime/engine.py, [Note: no host synchronisation in a step])."""
    got, seen = _run(3, "fp16", "config", "warn")
    if ON_GPU:
        assert len(seen) == STEPS - 1, seen  # one per optimizer step, nothing else
    assert_trains_like(got, _reference("fp16"), "fp16", "stage 3 fp16", clip=CLIP)
