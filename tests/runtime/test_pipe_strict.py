"""The pipeline engine under the device-strict mode (``DS_STRATEGY_DEVICE_STRICT=1``, see [Note: device-strict
mode] in ds_strategy/accelerator/strict.py): every collective and point-to-point message of the pipeline
(activations, gradients, link headers, the tied-weight broadcast and gradient sum, the cross-stage norm, the
loss average, the failure agreement) and of its checkpoints carries device memory, as NCCL requires, and the
optimizer step reads nothing back to the host (the cross-stage norm stays on the device).

Two grids: 2 stages (2 processes) and 2 stages x 2 data-parallel ranks (4 processes), with ZeRO-1,
gradient clipping and a tied weight (and the 2-stage run once more with the optimizer offloaded to the
host), through torch.distributed (``DS_STRATEGY_SHM=0``; the strict mode switches the shared-memory
channels off anyway). Each run trains, saves, loads the checkpoint into a fresh engine at another grid
(pipe 2 -> pipe 1 x data 2; pipe 2 x data 2 -> pipe 4 x data 1), trains on, and is compared with the
single-process torch reference (tests/runtime/pipe_common.py; fp32: losses rtol 1e-5, weights atol 1e-6).
The save is also watched: every collective it issues is an object collective's byte tensor (the tag, file
names and sizes the ranks agree on), none carries a parameter or optimizer value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import Reference, data, pipe_config, reference_run, specs

pytestmark = [pytest.mark.multiprocess]

STRICT = {"DS_STRATEGY_DEVICE_STRICT": "1"}
NO_SHM = {"DS_STRATEGY_SHM": "0"}
STEPS, SAVED_AT, MICRO, GAS, LR, CLIP = 4, 2, 2, 3, 1e-2, 0.05


def _collectives_during(fn: Any) -> list[tuple[str, str, int]]:
    """(op, dtype, bytes) of every tensor handed to a torch.distributed collective while ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[tuple[str, str, int]] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace in ("c10d", "_c10d_functional"):
                stack = [args, kwargs or {}]
                while stack:
                    v = stack.pop()
                    if isinstance(v, torch.Tensor):
                        seen.append((func._opname, str(v.dtype), v.nbytes))
                    elif isinstance(v, (list, tuple)):
                        stack.extend(v)
                    elif isinstance(v, dict):
                        stack.extend(v.values())
            return func(*args, **(kwargs or {}))

    with Watch():
        fn()
    return seen


def _run(rank: int, world: int, root: str, stages_after: int, offload: bool) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.accelerator import strict
    from ds_strategy.pipe import PipelineModule
    from ds_strategy.utils import safe_get_full_fp32_param

    assert strict.ACTIVE
    cfg = pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=CLIP)
    if offload:  # the optimizer's masters and gradients on the host, the stage's compute on the device
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    out: dict[str, Any] = {"losses": []}
    for stages, steps in ((2, range(SAVED_AT)), (stages_after, range(SAVED_AT, STEPS))):
        module = PipelineModule(
            specs(), num_stages=stages, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform"
        )
        engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
        dev = engine.device
        assert dev == torch.device("cpu", 0), dev
        if steps[0] > 0:
            engine.load_checkpoint(root)
            assert engine.global_steps == SAVED_AT
        # every data-parallel rank sees the same micro-batches: the reference does not depend on the grid
        batches = data(STEPS, 1, GAS, MICRO)
        for s in steps:
            micro = [(x.to(dev), y.to(dev)) for x, y in batches[s][0]]
            out["losses"].append(float(engine.train_batch(iter(micro))))
        if steps[0] == 0:
            out["save"] = _collectives_during(lambda: engine.save_checkpoint(root))  # noqa: B023 - called here
            out["eval"] = float(engine.eval_batch(iter([(x.to(dev), y.to(dev)) for x, y in batches[0][0]])))
        out["weights"] = {n: safe_get_full_fp32_param(p).cpu().clone() for n, p in module.named_parameters()}
        engine.destroy()
    return out


@pytest.mark.parametrize(
    ("world", "stages_after", "offload"),
    [(2, 1, False), (4, 4, False), (2, 1, True)],
    ids=["pipe2", "pipe2xdata2", "pipe2-offload"],
)
def test_pipeline_trains_saves_and_resumes_under_the_strict_mode(
    tmp_path: Path, world: int, stages_after: int, offload: bool
) -> None:
    results = run_distributed(
        _run,
        world_size=world,
        args=(str(tmp_path), stages_after, offload),
        env=NO_SHM,
        process_env=STRICT,
        timeout=300,
    )
    batches = data(STEPS, 1, GAS, MICRO)
    ref_losses, ref_weights = reference_run(batches, lr=LR, clip=CLIP)
    names = set()
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-6, msg=name)
        names |= set(r["weights"])
        # the save's collectives: object collectives' bytes (uint8) and their sizes (int64), a few hundred
        # bytes in all; never a float tensor (the old format all-reduced every parameter and state in full)
        assert r["save"], "the ranks agree on the tag and the file sizes through object collectives"
        assert {dtype for _, dtype, _ in r["save"]} <= {"torch.uint8", "torch.int64"}, r["save"]
        assert sum(n for _, _, n in r["save"]) < 16384, r["save"]
    assert names == set(ref_weights)  # the resumed grid holds every parameter somewhere
    # eval_batch (its loss average and broadcast) at the saved weights, on every rank
    _, saved_weights = reference_run(batches[:SAVED_AT], lr=LR, clip=CLIP)
    model = Reference()
    model.load_state_dict(saved_weights)
    with torch.no_grad():
        ref_eval = torch.stack([nn.functional.mse_loss(model(x), y) for x, y in batches[0][0]]).mean()
    for r in results:
        torch.testing.assert_close(torch.tensor(r["eval"]), ref_eval, rtol=1e-5, atol=0)
