"""Stage 3 partitions frozen parameters (``requires_grad=False``) like trainable ones, on 2 ranks.

A LoRA-shaped model (a frozen base of Linears and an embedding, trainable low-rank adapters and head) trains
at stage 3 exactly like single-process torch (fp32: the tolerances of test_stage3.py; bf16: those of the
activation-checkpointing matrix), while each rank holds half of the frozen base; frozen buckets are freed in
backward once their module's input gradients exist (the live limit holds); checkpoints carry the frozen
partitions across stages and world sizes, and ``exclude_frozen_parameters`` leaves them out.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import config, engine_run, groups_of, reference_run

D, R, VOCAB, STEPS, MICRO, GAS, LR = 32, 4, 24, 4, 2, 2, 1e-2
STAGE3 = {"stage3_param_persistence_threshold": 40, "stage3_max_live_parameters": 3000}


class LoraLinear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Linear(d, R, bias=False)
        b = nn.Linear(R, d, bias=False)
        nn.init.normal_(b.weight, std=0.1)  # non-zero: the adapters matter from the first step
        self.b = b  # initialised before it is attached: final when zero.Init partitions it
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class Adapted(nn.Module):
    """A frozen embedding and base, adapters in two blocks, a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([LoraLinear(D) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def make_adapted(seed: int = 0) -> Adapted:
    torch.manual_seed(seed)
    return Adapted()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    rows = MICRO * 2 * GAS
    return [
        (torch.randint(0, VOCAB, (rows, 6), generator=g), torch.randint(0, VOCAB, (rows, 6), generator=g))
        for _ in range(STEPS)
    ]


def _cfg(stage: int, precision: str = "fp32", offload_param: bool = False) -> dict[str, Any]:
    cfg = config(stage=stage, precision=precision, micro=MICRO, gas=GAS, lr=LR)
    if stage == 3:
        cfg["zero_optimization"].update(STAGE3, offload_param={"device": "cpu" if offload_param else "none"})
    return cfg


def _frozen_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def _train_grid(rank: int, world: int) -> list[dict[str, Any]]:
    import ds_strategy

    out = []
    for precision, offload in (("fp32", False), ("fp32", True), ("bf16", False)):
        model = make_adapted()
        full_frozen = _frozen_numel(model)
        ref = reference_run(
            make_adapted(), _data(), precision=precision, micro=MICRO, world=world, gas=GAS, lr=LR, clip=0.0
        )
        engine, *_ = ds_strategy.initialize(
            model=model,
            model_parameters=groups_of(model),  # the reference's param groups (frozen ones are skipped)
            config=_cfg(3, precision, offload),
        )
        stage = engine.stage
        frozen_part = sum(gs.part.numel() for gs in stage.frozen)
        at_rest = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}
        trace = engine_run(engine, _data(), micro=MICRO, gas=GAS)
        out.append(
            {
                "label": f"{precision} offload_param={offload}",
                "precision": precision,
                "losses": trace.losses,
                "ref_losses": ref.losses,
                "params": trace.params,
                "ref_params": ref.params,
                "full_frozen": full_frozen,
                "frozen_part": frozen_part,
                "at_rest": at_rest,
                "peak_live": stage.gatherer.peak_live,
                "no_optimizer_state_for_frozen": all(
                    p.requires_grad for group in engine.optimizer.param_groups for p in group["params"]
                )
                and len(stage.frozen[0].masters) == 0,
                "part_device": str(stage.frozen[0].part.device),
            }
        )
        engine.destroy()
    return out


@pytest.mark.multiprocess
def test_frozen_parameters_are_partitioned_and_train_like_torch() -> None:
    for results in run_distributed(_train_grid, world_size=2, timeout=300):
        for r in results:
            label = r["label"]
            # Half of the frozen base per rank (plus padding to the world size per bucket), none at rest.
            assert r["frozen_part"] <= r["full_frozen"] // 2 + 64, label
            assert r["at_rest"]["embed.weight"] == 0 and r["at_rest"]["blocks.0.base.weight"] == 0, label
            assert r["no_optimizer_state_for_frozen"], label
            assert r["peak_live"] <= STAGE3["stage3_max_live_parameters"], label
            if r["precision"] == "fp32":
                torch.testing.assert_close(
                    torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=4e-7, atol=1e-7
                )
                for name, value in r["ref_params"].items():
                    torch.testing.assert_close(r["params"][name], value, rtol=4e-6, atol=1e-6, msg=f"{label} {name}")
            else:  # bf16: the reference runs the same 16-bit per-rank compute (see common.reference_run)
                torch.testing.assert_close(
                    torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=2e-3, atol=2e-3
                )
                for name, value in r["ref_params"].items():
                    torch.testing.assert_close(r["params"][name], value, rtol=2e-2, atol=2e-3, msg=f"{label} {name}")
        assert results[1]["part_device"] == "cpu"


def _frozen_state(engine: Any) -> dict[str, torch.Tensor]:
    from ds_strategy.zero import GatheredParameters

    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    with GatheredParameters(frozen):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}


def _checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.runtime.checkpoint import consolidate_fp32_state_dict

    def build(stage: int, seed: int) -> Any:
        model = make_adapted(seed)
        params = [p for p in model.parameters() if p.requires_grad]
        return ds_strategy.initialize(model=model, model_parameters=params, config=_cfg(stage))[0]

    src = build(3, 0)
    engine_run(src, _data()[:2], micro=MICRO, gas=GAS)
    saved = _frozen_state(src)
    src.save_checkpoint(root, tag="full")
    src.save_checkpoint(root, tag="adapters", exclude_frozen_parameters=True)
    x = _data()[0][0][:MICRO]
    with torch.no_grad():
        expected = float(src(x, x))
    out: dict[str, Any] = {"expected": expected, "saved": saved}
    src.destroy()
    for stage in (3, 2):  # another base (seed 1): the checkpoint's frozen values must replace it
        other = build(stage, 1)
        other.load_checkpoint(root, tag="full")
        with torch.no_grad():
            out[f"loss_full_stage{stage}"] = float(other(x, x))
        out[f"frozen_stage{stage}"] = _frozen_state(other)
        other.destroy()
    same_base = build(3, 0)  # adapters only: the engine keeps the base it was built with
    same_base.load_checkpoint(root, tag="adapters")
    with torch.no_grad():
        out["loss_adapters"] = float(same_base(x, x))
    same_base.destroy()
    dist.barrier()
    if rank == 0:
        out["consolidated"] = {k: v.clone() for k, v in consolidate_fp32_state_dict(root, "full").items()}
        out["consolidated_adapters"] = sorted(consolidate_fp32_state_dict(root, "adapters"))
        sizes = {tag: sum(f.stat().st_size for f in (Path(root) / tag).iterdir()) for tag in ("full", "adapters")}
        out["sizes"] = sizes
    return out


@pytest.mark.multiprocess
def test_frozen_partitions_in_checkpoints(tmp_path: Path) -> None:
    results = run_distributed(_checkpoints, world_size=2, args=(str(tmp_path),), timeout=300)
    r = results[0]
    for stage in (3, 2):
        assert r[f"loss_full_stage{stage}"] == pytest.approx(r["expected"], rel=1e-6), stage
        for name, value in r["saved"].items():
            torch.testing.assert_close(r[f"frozen_stage{stage}"][name], value, rtol=0, atol=0, msg=name)
    assert r["loss_adapters"] == pytest.approx(r["expected"], rel=1e-6)
    for name, value in r["saved"].items():
        torch.testing.assert_close(r["consolidated"][name], value, rtol=0, atol=0, msg=name)
    frozen_names = set(r["saved"])
    assert frozen_names and not frozen_names & set(r["consolidated_adapters"])
    assert "head.weight" in r["consolidated_adapters"]
    assert r["sizes"]["adapters"] < r["sizes"]["full"]


def _zero_init_frozen(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy

    ds_cfg = _cfg(3)
    with ds_strategy.zero.Init():
        model = make_adapted()
    for p in model.parameters():  # a base frozen after a partitioned build (LoRA on a zero.Init model)
        if p.requires_grad and p.ndim == 2 and p.shape[0] == D and p.shape[1] == D:
            p.requires_grad_(False)
    reference = make_adapted()
    for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        q.requires_grad_(p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = ds_strategy.initialize(model=model, model_parameters=params, config=ds_cfg)[0]
    persistent = STAGE3["stage3_param_persistence_threshold"]  # smaller ones stay gathered by design
    whole_at_rest = [n for n, p in model.named_parameters() if not p.requires_grad and p.numel() >= persistent]
    x = _data()[0][0][:MICRO]
    with torch.no_grad():
        loss, ref = float(engine(x, x)), float(copy.deepcopy(reference)(x, x))
    engine.destroy()
    return {"whole_at_rest": whole_at_rest, "loss": loss, "ref": ref}


@pytest.mark.multiprocess
def test_zero_init_then_frozen_stays_partitioned() -> None:
    for r in run_distributed(_zero_init_frozen, world_size=2):
        assert r["whole_at_rest"] == []
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-6)
