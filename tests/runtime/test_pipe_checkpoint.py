"""Pipeline checkpoints: per-layer files that load at another depth, into a plain ZeroEngine, and through
``ds-zero-to-fp32``; training resumed from a checkpoint continues exactly as without the interruption.

Runs on 4 processes: save at pipe 2 x data 2 (ZeRO-1), load at pipe 4 and at pipe 1 x data 4, continue
training, and compare with the uninterrupted reference (fp32: losses rtol 1e-5, weights atol 1e-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.pipe_common import data, pipe_config, reference_run, specs

MICRO, GAS, LR = 2, 4, 1e-2


def _save_then_load(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.pipe import PipelineModule
    from ds_strategy.utils import safe_get_full_fp32_param

    batches = data(4, 1, GAS, MICRO)  # every data-parallel rank sees the same micro-batches: the reference is dp-free
    cfg = pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=0.05)
    out: dict[str, Any] = {}
    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True, partition_method="uniform")
    engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
    out["first"] = [float(engine.train_batch(iter(step[0]))) for step in batches[:2]]
    engine.save_checkpoint(root, client_state={"note": "half"})
    for stages in (4, 1):
        module = PipelineModule(
            specs(), num_stages=stages, loss_fn=nn.MSELoss(), seed_layers=False, partition_method="uniform"
        )
        engine, _, _, _ = ds_strategy.initialize(model=module, config=cfg)
        tag_dir, client = engine.load_checkpoint(root)
        assert client == {"note": "half"} and Path(tag_dir).name == "global_step2"
        assert engine.global_steps == 2
        out[f"resumed{stages}"] = [float(engine.train_batch(iter(step[0]))) for step in batches[2:]]
        out[f"weights{stages}"] = {n: safe_get_full_fp32_param(p).clone() for n, p in module.named_parameters()}
    # a plain ZeroEngine over a one-stage model takes the consolidated weights
    from ds_strategy.runtime.pipe.files import pipe_state_dict

    plain = PipelineModule(specs(), num_stages=1, loss_fn=nn.MSELoss(), partition_method="uniform")
    zero = ds_strategy.ZeroEngine(plain, ds_strategy.config.load_config(cfg, world_size=world))
    zero.load_full_state_dict(pipe_state_dict(root))
    out["plain"] = {n: p.detach().clone() for n, p in plain.named_parameters()}
    return out


def test_checkpoint_loads_at_other_depths(tmp_path: Path) -> None:
    results = run_distributed(_save_then_load, world_size=4, args=(str(tmp_path),), timeout=240)
    ref_losses, ref_weights = reference_run(data(4, 1, GAS, MICRO), lr=LR, clip=0.05)
    _, half_weights = reference_run(data(2, 1, GAS, MICRO), lr=LR, clip=0.05)
    files = sorted(p.name for p in (tmp_path / "global_step2").iterdir())
    assert files == ["pipe_meta.pt", *(f"pipe_rank_{r:05d}_states.pt" for r in range(4))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "latest", "model.pt"][:2]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["first"]), torch.tensor(ref_losses[:2]), rtol=1e-5, atol=0)
        for stages in (4, 1):
            torch.testing.assert_close(
                torch.tensor(r[f"resumed{stages}"]), torch.tensor(ref_losses[2:]), rtol=1e-5, atol=0
            )
            for name, value in r[f"weights{stages}"].items():
                torch.testing.assert_close(value, ref_weights[name], rtol=0, atol=1e-6, msg=name)
        for name, value in r["plain"].items():
            torch.testing.assert_close(value, half_weights[name], rtol=0, atol=1e-6, msg=name)
    # ds-zero-to-fp32 writes the same one-stage state dict
    from ds_strategy.runtime.checkpoint.consolidate import main

    assert main([str(tmp_path), str(tmp_path / "model.pt")]) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(half_weights)
    for name, value in state.items():
        torch.testing.assert_close(value, half_weights[name], rtol=0, atol=1e-6, msg=name)
