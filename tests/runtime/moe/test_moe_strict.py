"""MoE under the device-strict mode (issue 42, criterion 3): every collective of expert-parallel training,
full-value reads and checkpoints carries device memory only, as NCCL requires (see [Note: device-strict
mode] in ds_strategy/accelerator/strict.py), and the training step reads nothing back to the host.

4 ranks, ``ep_size`` 2: two experts per rank, and each expert replicated on 2 ranks (its expert-data-parallel
group), so the experts' partitions, gradient reductions and checkpoint gathers all run over that group
(at 2 ranks with ``ep_size`` 2 each expert group has one rank and those collectives never run). Stages 1 and
2, with and without the optimizer offloaded to the host (whose masters and Adam state are host tensors: the
checkpoint's expert gather used to all-gather them as they were). Collectives go through torch.distributed
(``DS_STRATEGY_SHM=0``: the path a GPU group takes). Each run trains 3 steps against the single-process
model holding every expert (tests/runtime/moe/common.py), then reads every expert's full value, writes the
whole state dict, saves a checkpoint, loads it into a fresh engine and trains one more step, reading that
step's gradients first (``safe_get_full_grad`` and, as Lightning's hooks see them, ``p.grad``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.runtime.moe.common import data, full_model, local_model, local_view, reference_run

STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}
NO_SHM = {"DS_STRATEGY_SHM": "0"}
WORLD, EP = 4, 2
MICRO, STEPS, LR, CLIP = 2, 3, 1e-2, 0.05
TOL = {"rtol": 2e-5, "atol": 2e-6}


def _config(stage: int, offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "gradient_clipping": CLIP,
    }


def _steps(engine: Any, batches: list[Any], rank: int, world: int, grads: dict[str, Any] | None = None) -> list[float]:
    """Train; with ``grads``, the last step's gradients are read first, as safe_get_full_grad and as p.grad
    (Lightning's window: one all-gather per bucket over each group's communicator)."""
    from ds_strategy import utils

    dev = engine.device
    losses = []
    for i, (x, y) in enumerate(batches):
        loss, _, _ = engine(x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev))
        engine.backward(loss)
        if grads is not None and i == len(batches) - 1:
            full = {n: utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            with engine.state_access.visible_grads():
                for n, p in engine.module.named_parameters():
                    grads[n] = (p.grad.detach().float().cpu(), full[n].cpu())
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


def _body(rank: int, world: int, stage: int, offload: bool, root: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy import utils
    from ds_strategy.accelerator import strict

    ep_rank = rank % EP
    batches = data(STEPS + 1, MICRO * world)
    engine, *_ = ds_strategy.initialize(model=local_model(full_model(), EP, ep_rank), config=_config(stage, offload))
    assert strict.ACTIVE and engine.device == torch.device("cpu", 0), engine.device
    losses = _steps(engine, batches[:STEPS], rank, world)
    ref = reference_run(full_model(), batches, world, LR, CLIP)
    after = reference_run(full_model(), batches[:STEPS], world, LR, CLIP)["state"]
    mine = local_view(after, EP, ep_rank)
    fp32 = {}
    for name, p in engine.module.named_parameters():
        got = utils.safe_get_full_fp32_param(p)
        assert got is not None, name
        fp32[name] = (got.cpu(), mine[name])
    whole = engine.full_state_dict(rank=None)  # every expert, gathered over the expert-parallel group
    engine.save_checkpoint(root, tag="three")
    engine.destroy()

    other = local_model(full_model(seed=7), EP, ep_rank)
    engine, *_ = ds_strategy.initialize(model=other, config=_config(stage, offload))
    engine.load_checkpoint(root, tag="three")
    grads: dict[str, Any] = {}
    resumed = _steps(engine, batches[STEPS:], rank, world, grads)
    engine.destroy()
    return {
        "losses": losses + resumed,
        "ref_losses": ref["losses"],
        "fp32": fp32,
        "whole": {k: v.float() for k, v in whole.items()},
        "ref_whole": after,
        "grads": grads,
    }


CASES = [(stage, offload) for stage in (1, 2) for offload in (False, True)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("stage", "offload"), CASES, ids=[f"stage{s}{'-offload' if o else ''}" for s, o in CASES])
def test_moe_trains_reads_and_checkpoints_under_the_strict_mode(tmp_path: Path, stage: int, offload: bool) -> None:
    results = run_distributed(
        _body, world_size=WORLD, args=(stage, offload, str(tmp_path)), env=NO_SHM, process_env=STRICT, timeout=300
    )
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["losses"], r["ref_losses"], **TOL, msg=lambda m, r=rank: f"rank {r}: {m}")
        for name, (got, want) in r["fp32"].items():
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name, r=rank: f"{n} on rank {r}: {m}")
        assert set(r["whole"]) == set(r["ref_whole"])
        assert r["grads"]
        for name, (as_p_grad, full) in r["grads"].items():
            torch.testing.assert_close(as_p_grad, full, **TOL, msg=lambda m, n=name, r=rank: f"{n} on rank {r}: {m}")
        for name, want in r["ref_whole"].items():
            torch.testing.assert_close(r["whole"][name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
