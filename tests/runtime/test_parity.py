"""The proof: on 2 ranks, every stage x precision x offload trains exactly like a single-process reference.

One ``run_distributed`` call per stage runs all of that stage's precision/offload combinations (20
optimizer steps each, 2 micro-steps of 2 rows per rank, two param groups, small buckets so a parameter
spans several buckets and one bucket holds a single oversized parameter, a never-used Linear and a frozen
parameter). Each rank computes the reference itself (no communication), so the comparison happens here.

Tolerances, and why:
- fp32: rtol 1e-5. The engine sums per-rank mean gradients instead of differentiating the mean over
  the whole batch, and steps a fused AdamW: the same math with fp32 rounding in other places
  (observed: losses within 3e-7 relative, weights within 1.2e-7 absolute).
- bf16/fp16: the reference does the same 16-bit forward/backward per (micro-step, rank) slice with fp32
  master weights, so the only differences are the fp32 summation order of the gradients and the
  optimizer implementation. Observed: the 16-bit weights are bit-identical and the losses agree to 1e-7.
  Allowed: losses rtol 1e-5, fp32 masters rtol 1e-4 (rounding noise of fp32 gradient sums passes
  through Adam's normalisation), 16-bit weights one unit in the last place (bf16 2**-8, fp16 2**-11
  relative), because a master value sitting on a rounding boundary may round the other way.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import batches, config, engine_run, groups_of, make_model, reference_run

STEPS = 20
MICRO, GAS, WORLD = 2, 2, 2
LR = 1e-2

TOLERANCES = {  # (losses rtol, 16-bit weights rtol, masters rtol)
    "fp32": (1e-5, 1e-5, 1e-5),
    "bf16": (1e-5, 2.0**-8, 1e-4),
    "fp16": (1e-5, 2.0**-11, 1e-4),
}


def _combos(stage: int) -> list[dict[str, object]]:
    out = []
    for precision in ("fp32", "bf16", "fp16"):
        for offload in (False, True) if stage > 0 else (False,):
            out.append(
                {
                    "precision": precision,
                    "offload": offload,
                    # clipping engaged in half the runs; synchronous and overlapped reductions both covered
                    "clip": 0.3 if (precision == "bf16") != offload else 0.0,
                    "overlap": not offload,
                }
            )
    return out


def _stage_grid(rank: int, world: int, stage: int) -> list[dict[str, object]]:
    import ds_strategy.runtime as rt

    data = batches(STEPS, MICRO * GAS * world)
    results = []
    for combo in _combos(stage):
        precision, clip = str(combo["precision"]), float(combo["clip"])  # type: ignore[arg-type]
        model = make_model()
        reference = reference_run(
            make_model(),
            data,
            precision=precision,
            micro=MICRO,
            world=world,
            gas=GAS,
            lr=LR,
            clip=clip,
            loss_scale=2.0**8 if precision == "fp16" else 1.0,
        )
        cfg = config(
            stage=stage,
            precision=precision,
            offload=bool(combo["offload"]),
            micro=MICRO,
            gas=GAS,
            lr=LR,
            clip=clip,
            overlap=bool(combo["overlap"]),
        )
        if combo["offload"]:
            cfg["zero_force_ds_cpu_optimizer"] = False
        engine, _, _, _ = rt.initialize(model=model, model_parameters=groups_of(model), config=cfg)
        trace = engine_run(engine, data, micro=MICRO, gas=GAS)
        results.append(
            {
                **combo,
                "engine": trace,
                "reference": reference,
                "skipped": engine.skipped_steps,
                "buckets": [len(gs.layout.buckets) for gs in engine.stage.groups],
            }
        )
        engine.destroy()
    return results


def _check(result: dict[str, object]) -> None:
    eng, ref = result["engine"], result["reference"]
    precision = str(result["precision"])
    loss_tol, param_tol, master_tol = TOLERANCES[precision]
    label = f"{precision} offload={result['offload']} clip={result['clip']}"
    assert result["skipped"] == 0, label
    torch.testing.assert_close(
        torch.tensor(eng.losses),
        torch.tensor(ref.losses),
        rtol=loss_tol,
        atol=1e-6,  # type: ignore[attr-defined]
        msg=lambda m: f"{label} losses: {m}",
    )
    for name, value in ref.masters.items():  # type: ignore[attr-defined]
        if not value.requires_grad and name == "frozen":
            continue
        torch.testing.assert_close(
            eng.masters[name],
            value,
            rtol=master_tol,
            atol=1e-6,  # type: ignore[attr-defined]
            msg=lambda m, n=name: f"{label} master {n}: {m}",
        )
    for name, value in ref.params.items():  # type: ignore[attr-defined]
        torch.testing.assert_close(
            eng.params[name],
            value,
            rtol=param_tol,
            atol=1e-6,  # type: ignore[attr-defined]
            msg=lambda m, n=name: f"{label} weight {n}: {m}",
        )
    if float(result["clip"]) > 0:  # type: ignore[arg-type]
        assert max(ref.norms) > float(result["clip"]), f"{label}: clipping never engaged"  # type: ignore[attr-defined, arg-type]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_matches_single_process_reference(stage: int) -> None:
    ranks = run_distributed(_stage_grid, world_size=WORLD, args=(stage,), timeout=300)
    for rank_results in ranks:
        for result in rank_results:
            assert max(result["buckets"]) > 2, "the test must exercise several buckets per group"
            _check(result)
    # Both ranks hold identical weights after every gather.
    for a, b in zip(ranks[0], ranks[1], strict=True):
        for name, value in a["engine"].params.items():
            assert torch.equal(value, b["engine"].params[name]), name


def _accumulation(rank: int, world: int) -> dict[str, object]:
    """4 micro-steps of 2 rows == 1 micro-step of 8 rows (same global batch of 16), stages 1 and 2."""
    import ds_strategy.runtime as rt

    data = batches(10, 16)
    out: dict[str, object] = {}
    for stage in (1, 2):
        for micro, gas in ((2, 4), (8, 1)):
            model = make_model()
            engine, _, _, _ = rt.initialize(
                model=model,
                model_parameters=groups_of(model),
                config=config(stage=stage, micro=micro, gas=gas, clip=0.3),
            )
            out[f"{stage}-{micro}x{gas}"] = engine_run(engine, data, micro=micro, gas=gas)
            engine.destroy()
    out["reference"] = reference_run(make_model(), data, precision="fp32", micro=8, world=world, gas=1, lr=LR, clip=0.3)
    return out


@pytest.mark.multiprocess
def test_gradient_accumulation_equals_bigger_micro_batch() -> None:
    out = run_distributed(_accumulation, world_size=WORLD)[0]
    ref = out["reference"]
    for stage in (1, 2):
        small, big = out[f"{stage}-2x4"], out[f"{stage}-8x1"]
        torch.testing.assert_close(torch.tensor(small.losses), torch.tensor(big.losses), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(small.losses), torch.tensor(ref.losses), rtol=1e-5, atol=1e-6)
        for name, value in ref.params.items():
            torch.testing.assert_close(small.params[name], big.params[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(small.params[name], value, rtol=1e-5, atol=1e-6)
