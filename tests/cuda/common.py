"""Shared pieces of the CUDA suite: where it runs, the device checks, and engine runs that keep every
tensor on the device (tests/runtime/common.py's helpers leave host scratch that NCCL would refuse).

The suite runs where ``torch.cuda.is_available()``; elsewhere every module skips with ``SKIP_REASON``.

[Note: rehearsal on CPU]
``DS_STRATEGY_CUDA_REHEARSAL=1 python -m pytest tests/cuda`` runs the suite on a CPU-only machine as the
GPU would, as far as a CPU can: the device-strict mode (ds_strategy/accelerator/strict.py) stands in for
the GPU (the compute device is ``cpu:0``, every collective on host memory raises as NCCL would), gloo
stands in for NCCL and Lightning's ``accelerator="cpu"`` for ``"gpu"``. What only a GPU has (the CUDA
kernels, ``torch.cuda.max_memory_allocated``, pinned memory) is skipped. It proves the tests themselves
(their references, helpers and fixtures) before a GPU is at hand; run ``tests/cuda`` alone (the mode is
entered when ds_strategy is first imported).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

REHEARSAL_ENV = "DS_STRATEGY_CUDA_REHEARSAL"
REHEARSAL = os.environ.get(REHEARSAL_ENV, "").strip().lower() in ("1", "true", "yes", "on")
STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}
if REHEARSAL:
    os.environ.update(STRICT)  # before ds_strategy.accelerator is imported (the mode is entered then)

ON_GPU = torch.cuda.is_available() and not REHEARSAL
SKIP_REASON = (
    f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
    "torch.cuda.is_available() is False): the CUDA suite runs on a GPU machine (nox -s cuda, docs/gpu.md)"
)
# Every module of the suite: pytestmark = [requires_gpu, ...]
requires_gpu = pytest.mark.skipif(not (ON_GPU or REHEARSAL), reason=SKIP_REASON)
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a real CUDA device (not rehearsed on CPU)")

BACKEND = "nccl" if ON_GPU else "gloo"  # world size 1 on one GPU
ACCELERATOR = "gpu" if ON_GPU else "cpu"  # Lightning's name
# Worker processes of tests/harness.py: the strict mode must be on from their start in a rehearsal.
PROCESS_ENV: dict[str, str] | None = None if ON_GPU else STRICT


def device() -> torch.device:
    """The compute device: cuda:0, or the strict mode's cpu:0 in a rehearsal."""
    if ON_GPU:
        return torch.device("cuda", 0)
    from ds_strategy.accelerator import strict

    if not strict.ACTIVE:
        raise RuntimeError(
            f"{REHEARSAL_ENV}=1 needs the device-strict mode from the start: run tests/cuda alone "
            "(ds_strategy was imported before tests/cuda/common.py set DS_STRATEGY_DEVICE_STRICT)"
        )
    return strict.device()


def on_device(t: torch.Tensor) -> bool:
    """Device memory: a CUDA tensor (a tagged one in a rehearsal)."""
    if ON_GPU:
        return t.device.type == "cuda"
    from ds_strategy.accelerator import strict

    return strict.is_device_tensor(t)


def on_host(t: torch.Tensor, pinned: bool) -> bool:
    """Host memory, page-locked when ``pinned`` (only a GPU machine pins: a rehearsal checks the host)."""
    if t.device.type != "cpu":
        return False
    if not ON_GPU:
        return not on_device(t)
    return t.is_pinned() or not pinned


# ---- a process group of one ------------------------------------------------------------------------------


_SAVED_ENV: dict[str, str | None] = {}
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def init_single_process_group() -> None:
    """World size 1 on this GPU with NCCL (gloo in a rehearsal), as ``torchrun --nproc-per-node 1`` would."""
    from tests.harness import held_port

    _SAVED_ENV.update({k: os.environ.get(k) for k in _RENDEZVOUS})
    if ON_GPU:
        torch.cuda.set_device(0)
    with held_port() as port:  # reserved until the group's store listens on it
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(BACKEND, rank=0, world_size=1)


def destroy_process_group() -> None:
    """Destroy the group and restore the rendezvous variables (the worker pools spawned later inherit them)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in _SAVED_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _SAVED_ENV.clear()


# ---- engine runs with every tensor on the device ----------------------------------------------------------


def full_masters(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master (on the host), assembled from all ranks' shards with the
    all-reduces on the compute device (tests/runtime/common.py's ``full_masters`` reduces host scratch)."""
    dev = engine.device
    out: dict[str, torch.Tensor] = {}
    for gs, masters in zip(engine.stage.groups, engine.stage.masters, strict=True):
        layout = gs.layout
        if not gs.partitioned:
            for slot in layout.params:
                bucket = layout.buckets[slot.bucket]
                data = masters[slot.bucket].detach()[slot.offset - bucket.start : slot.end - bucket.start]
                out[slot.name] = data.float().cpu().view(slot.shape)
            continue
        partition = torch.cat([m.detach().float().to(dev) for m in masters]) if masters else None
        for slot_index, slot in enumerate(layout.params):
            full = torch.zeros(slot.numel, device=dev)
            for piece in layout.shard_pieces(engine.dp_rank):
                if piece.param != slot_index or partition is None:
                    continue
                full[piece.param_offset : piece.param_offset + piece.numel] = partition[
                    piece.partition_offset : piece.partition_offset + piece.numel
                ]
            dist.all_reduce(full)
            out[slot.name] = full.cpu().view(slot.shape)
    return out


def engine_run(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]], *, micro: int, gas: int) -> dict[str, Any]:
    """Train on this rank's slices of ``data`` (moved to the engine's device); losses are global means
    (all-reduced on the device); weights and masters come back on the host."""
    from ds_strategy.zero import GatheredParameters
    from tests.runtime.common import micro_slice

    world, rank, dev = engine.dp_world_size, engine.dp_rank, engine.device
    losses, norms = [], []
    for batch in data:
        total = torch.zeros((), device=dev)
        for m in range(gas):
            x, y = (t.to(dev) for t in micro_slice(batch, micro, world, m, rank))
            loss = engine(x, y)
            assert on_device(loss), f"the loss was computed on {loss.device}, not on the compute device {dev}"
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / (gas * world))
        norms.append(float(engine.get_global_grad_norm()))
    with GatheredParameters(list(engine.module.parameters())):  # stage 3: whole for the copy; else a no-op
        gathered_on_device = all(on_device(p) for p in engine.module.parameters())
        params = {n: p.detach().float().cpu() for n, p in engine.module.named_parameters()}
    with engine.stage.resident():  # NVMe offload: the masters in memory for the copy; else a no-op
        masters = full_masters(engine)
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "masters": masters,
        "gathered_on_device": gathered_on_device,
        "skipped": engine.skipped_steps,
    }


def reference_on_device(data: list[tuple[torch.Tensor, torch.Tensor]], **kwargs: Any) -> dict[str, Any]:
    """tests/runtime/common.py's single-process torch reference, computed on the compute device."""
    from tests.runtime.common import make_model, reference_run

    dev = device()
    trace = reference_run(make_model().to(dev), [(x.to(dev), y.to(dev)) for x, y in data], **kwargs)
    return {
        "losses": trace.losses,
        "norms": trace.norms,
        "params": {k: v.cpu() for k, v in trace.params.items()},
        "masters": {k: v.cpu() for k, v in trace.masters.items()},
    }


# ---- the comparison ---------------------------------------------------------------------------------------

# Per precision: (losses rtol, gradient norms rtol, weights (rtol, atol), fp32 masters (rtol, atol)).
# fp32: tests/runtime/test_parity.py's, which states why (the same math, fp32 rounding in other places).
# 16 bits: looser than on CPU, where the engine and the reference run the same kernels and agree to
# 1e-7. On a GPU, cuBLAS picks its GEMM kernel by shape *and pointer alignment*: the engine's weights are
# views into flat buffers at arbitrary offsets, the reference's are fresh allocations, so the two may sum
# a product in different orders, and one bf16 unit (2**-8) or fp16 unit (2**-11) of an activation carries
# into the loss and the Adam update. Allowed: a few units of the 16-bit format in losses and weights, and
# master drift well below one learning-rate step (lr 1e-2: a wrong gradient moves a master by ~1e-2).
TOLERANCES: dict[str, tuple[float, float, tuple[float, float], tuple[float, float]]] = {
    "fp32": (1e-5, 1e-4, (1e-5, 1e-6), (1e-5, 1e-6)),
    "bf16": (2e-2, 5e-2, (3 * 2.0**-8, 1e-3), (1e-2, 1e-3)),
    "fp16": (5e-3, 1e-2, (3 * 2.0**-11, 2e-4), (5e-3, 2e-4)),
}


def assert_trains_like(got: dict[str, Any], ref: dict[str, Any], precision: str, label: str, clip: float) -> None:
    """``got`` (``engine_run``) against ``ref`` (``reference_on_device``) within ``TOLERANCES[precision]``."""
    loss_rtol, norm_rtol, (param_rtol, param_atol), (master_rtol, master_atol) = TOLERANCES[precision]
    assert got["skipped"] == 0, f"{label}: {got['skipped']} step(s) skipped"
    torch.testing.assert_close(
        torch.tensor(got["losses"]),
        torch.tensor(ref["losses"]),
        rtol=loss_rtol,
        atol=1e-6,
        msg=lambda m: f"{label} losses: {m}",
    )
    torch.testing.assert_close(
        torch.tensor(got["norms"]),
        torch.tensor(ref["norms"]),
        rtol=norm_rtol,
        atol=1e-6,
        msg=lambda m: f"{label} gradient norms: {m}",
    )
    if clip > 0:
        assert max(ref["norms"]) > clip, f"{label}: clipping never engaged"
    for name, value in ref["params"].items():
        torch.testing.assert_close(
            got["params"][name],
            value,
            rtol=param_rtol,
            atol=param_atol,
            msg=lambda m, n=name: f"{label} weight {n}: {m}",
        )
    for name, value in got["masters"].items():
        torch.testing.assert_close(
            value,
            ref["masters"][name],
            rtol=master_rtol,
            atol=master_atol,
            msg=lambda m, n=name: f"{label} master {n}: {m}",
        )


# ---- where the engine keeps its tensors --------------------------------------------------------------------


def _tensors(obj: Any, path: str, seen: set[int], depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts of ds_strategy's own
    objects (not the communicator, whose fast path owns host shared memory by design)."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", seen, depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]", seen, depth + 1)
    elif type(obj).__module__.startswith("ds_strategy.runtime") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if k in ("coll", "options", "module") or isinstance(v, nn.Module):
                continue
            yield from _tensors(v, f"{path}.{k}", seen, depth + 1)


def placement_errors(engine: Any, *, offload_optimizer: bool, offload_param: bool, pin_memory: bool) -> list[str]:
    """What sits in the wrong memory: the module's parameters and buffers on the device, the optimizer's
    state and masters on the device (host, pinned when asked, with optimizer offload), and without any
    offload every tensor the stage holds (flat buffers, gradients, partitions, scratch) on the device."""
    errors: list[str] = []
    for name, t in [*engine.module.named_parameters(), *engine.module.named_buffers()]:
        if not on_device(t):
            errors.append(f"module tensor {name} on {t.device}")
    for i, master in enumerate(m for masters in engine.stage.masters for m in masters):
        ok = on_host(master, pin_memory) if offload_optimizer else on_device(master)
        if not ok:
            errors.append(f"master {i} on {master.device} (pinned={master.is_pinned()})")
    for i, state in enumerate(engine.optimizer.state.values()):
        for key, t in state.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue  # step counters are host scalars in torch's optimizers too
            if not (on_host(t, pinned=False) if offload_optimizer else on_device(t)):
                errors.append(f"optimizer state {i}.{key} on {t.device}")
    if offload_param:
        for gs in engine.stage.groups:
            part = getattr(gs, "part", None)
            if part is not None and not on_host(part, pin_memory):
                errors.append(f"offloaded partition of group {gs.index} on {part.device} (pinned={part.is_pinned()})")
    if not (offload_optimizer or offload_param):
        for path, t in _tensors(engine.stage, "stage", set()):
            # Pinned host memory is host memory by design: the landing buffers of non-blocking copies (stage
            # 3's divergence summaries, read once their copy has landed: runtime/zero/divergence.py).
            if not on_device(t) and not (ON_GPU and t.is_pinned()):
                errors.append(f"{path}: {tuple(t.shape)} {t.dtype} on {t.device}")
    return errors
