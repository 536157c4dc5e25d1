"""Full-state access (``ds_strategy.utils.safe_get_*`` / ``safe_set_*``) against a single-process reference.

On 2 ranks, per stage (0-3), precision (fp32, bf16; fp16 at stages 1 and 3, for the loss-scale factor)
and optimizer offload (stages 2-3): a few AdamW steps of ``tests.runtime.common.Net`` (two param groups,
200-element buckets so parameters straddle buckets and shards, a never-used Linear and a frozen
parameter) beside a reference that runs the same per-(micro-step, rank) slices in the same dtype with
fp32 masters and ``torch.optim.AdamW`` (the reference of test_parity.py, with its gradients and state
kept). Checked:

- after each boundary backward: ``safe_get_full_grad`` of every trainable parameter = the reference's
  averaged, unscaled gradient; each rank's ``safe_get_local_grad``, concatenated in rank order, = the
  flattened full gradient;
- after each step: ``safe_get_full_fp32_param`` = the reference's fp32 weights, ``safe_get_full_optimizer_state``
  ``exp_avg`` / ``exp_avg_sq`` = ``torch.optim.AdamW``'s state; local fragments concatenate to the full
  values; the frozen parameter and a tensor no engine trains give None;
- setters: full fp32 param and optimizer state set before a forward, gradient (full, local, vectorized)
  and local fp32 param / optimizer state set between the boundary backward and the step; each reads back
  as written, and the reference, given the same edits, stays equal for two more steps (so the edited
  weights were what the forward used, and the edits were what the step applied); the last step's boundary
  backward is a plain ``loss.backward()``, which the first gradient access reduces (as ``step()`` would);
- when gradients are not readable (after the step, inside an accumulation window at stages 0-1), a
  RuntimeError says when they are.

Tolerances: fp32 rtol 1e-5 / atol 1e-6 (the per-rank sums run in another order than the reference's).
bf16 and fp16: gradients are computed in 16 bits per slice on both sides and summed in fp32; weights and
Adam states rtol 1e-4 (fp32 rounding noise of the gradient sums through Adam's normalisation, as in
test_parity.py). Observed (all stages): fp32 gradients within 1.2e-7, weights 3e-8, exp_avg 1.5e-8,
exp_avg_sq 1.5e-10 absolute; bf16/fp16 gradients and Adam states identical (fp16 stage-3 gradients
within 5e-10), fp32 masters within 3e-8.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.runtime.common import DTYPES, batches, config, groups_of, make_model, micro_slice

MICRO, GAS, WORLD = 2, 2, 2
LR = 1e-2
WARMUP = 3  # steps checked before the setters
TOL = {"fp32": (1e-5, 1e-6), "bf16": (1e-4, 1e-6), "fp16": (1e-4, 1e-6)}


class _Reference:
    """Single-process AdamW on fp32 masters, forward/backward per (micro-step, rank) slice in ``dtype``."""

    def __init__(self, model: torch.nn.Module, precision: str, loss_scale: float) -> None:
        self.masters = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(groups_of(self.masters), lr=LR)
        self.dtype = DTYPES[precision]
        self.compute = copy.deepcopy(self.masters).to(self.dtype)
        self.loss_scale = loss_scale
        self.p = dict(self.masters.named_parameters())

    def backward(self, batch: tuple[torch.Tensor, torch.Tensor], world: int) -> None:
        acc = {n: torch.zeros_like(p) for n, p in self.p.items() if p.requires_grad}
        for m in range(GAS):
            for r in range(world):
                x, y = micro_slice(batch, MICRO, world, m, r)
                loss = self.compute(x.to(self.dtype), y.to(self.dtype))
                (loss.float() * (self.loss_scale / GAS)).backward()
                for n, p in self.compute.named_parameters():
                    if p.grad is not None:
                        acc[n] += p.grad.float()
                        p.grad = None
        for n, a in acc.items():
            self.p[n].grad = a / (world * self.loss_scale)

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        for (_, src), dst in zip(self.masters.named_parameters(), self.compute.parameters(), strict=True):
            dst.copy_(src)

    def state(self, name: str, key: str) -> torch.Tensor:
        return self.opt.state[self.p[name]][key]


def _check_local(local: torch.Tensor | None, full: torch.Tensor | None, stage: int, what: str) -> None:
    """Stage 0: every rank's fragment is the whole parameter; stages 1-3: the fragments, concatenated in rank
    order, are the flattened parameter (each rank may hold any contiguous part, possibly none)."""
    assert local is not None and full is not None and local.ndim == 1, what
    if stage == 0:
        torch.testing.assert_close(local, full.reshape(-1), rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
        return
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.detach().cpu())
    joined = torch.cat(parts)
    torch.testing.assert_close(joined, full.reshape(-1).cpu(), rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _close(actual: torch.Tensor | None, expected: torch.Tensor, precision: str, what: str) -> None:
    assert actual is not None, f"{what}: got None"
    rtol, atol = TOL[precision]
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    torch.testing.assert_close(actual.cpu(), expected.float().cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_grads(engine: Any, ref: _Reference, stage: int, precision: str, label: str) -> None:
    from ds_strategy import utils

    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        full = utils.safe_get_full_grad(p)
        _close(full, ref.p[name].grad, precision, f"{label} grad {name}")
        assert full is not None and tuple(full.shape) == tuple(ref.p[name].shape), name
        _check_local(utils.safe_get_local_grad(p), full, stage, f"{label} local grad {name}")


def _check_state(engine: Any, ref: _Reference, stage: int, precision: str, label: str) -> None:
    from ds_strategy import utils

    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            assert utils.safe_get_full_fp32_param(p) is None, f"{label}: frozen {name} has a full fp32 param"
            assert utils.safe_get_local_fp32_param(p) is None
            continue
        full = utils.safe_get_full_fp32_param(p)
        _close(full, ref.p[name].detach(), precision, f"{label} fp32 param {name}")
        assert full is not None and tuple(full.shape) == tuple(ref.p[name].shape), name
        _check_local(utils.safe_get_local_fp32_param(p), full, stage, f"{label} local fp32 param {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            state = utils.safe_get_full_optimizer_state(p, key)
            _close(state, ref.state(name, key), precision, f"{label} {key} {name}")
            local = utils.safe_get_local_optimizer_state(p, key)
            _check_local(local, state, stage, f"{label} local {key} {name}")


def _run(rank: int, world: int, stage: int, precision: str, offload: bool) -> dict[str, Any]:
    import ds_strategy.runtime as rt
    from ds_strategy import utils

    loss_scale = 2.0**8 if precision == "fp16" else 1.0
    label = f"stage {stage} {precision} offload={offload}"
    data = batches(WARMUP + 2, MICRO * GAS * world)
    model = make_model()
    ref = _Reference(make_model(), precision, loss_scale)
    cfg = config(stage=stage, precision=precision, offload=offload, micro=MICRO, gas=GAS, lr=LR)
    if offload:
        cfg["zero_force_ds_cpu_optimizer"] = False
    engine, _, _, _ = rt.initialize(model=model, model_parameters=groups_of(model), config=cfg)
    params = dict(engine.module.named_parameters())
    assert utils.safe_get_full_fp32_param(torch.zeros(3)) is None  # no engine trains it
    assert utils.safe_get_full_grad(params["frozen"]) is None

    def train_step(step: int, before_step: Any = None, plain_boundary_backward: bool = False) -> None:
        batch = data[step]
        ref.backward(batch, world)
        for m in range(GAS):
            loss = engine(*micro_slice(batch, MICRO, world, m, rank))
            if plain_boundary_backward and m == GAS - 1:
                (loss.float() * (engine.loss_scale / GAS)).backward()  # not reduced: the first access reduces
            else:
                engine.backward(loss)
            if m < GAS - 1 and stage < 2:
                with pytest.raises(RuntimeError, match="accumulation window"):
                    utils.safe_get_full_grad(params["fc1.weight"])
            if m < GAS - 1:
                engine.step()  # DeepSpeed's loop: a step after every backward, applied at the boundary
        _check_grads(engine, ref, stage, precision, f"{label} step {step}")
        if before_step is not None:
            before_step()
        engine.step()
        ref.step()
        _check_state(engine, ref, stage, precision, f"{label} after step {step}")

    for step in range(WARMUP):
        train_step(step)
    with pytest.raises(RuntimeError, match="no gradient since the last optimizer step"):
        utils.safe_get_full_grad(params["fc1.weight"])

    # Set before a forward: the next forward must use the weights, the next step the state.
    new_w = ref.p["fc1.weight"].detach() * 0.5 + 0.01
    utils.safe_set_full_fp32_param(params["fc1.weight"], new_w)
    with torch.no_grad():
        ref.p["fc1.weight"].copy_(new_w)
    ref.sync()
    _close(utils.safe_get_full_fp32_param(params["fc1.weight"]), new_w, "fp32", f"{label} fp32 param round trip")
    new_m = ref.state("fc2.weight", "exp_avg") * 2 + 0.001
    utils.safe_set_full_optimizer_state(params["fc2.weight"], new_m, "exp_avg")
    ref.state("fc2.weight", "exp_avg").copy_(new_m)
    _close(utils.safe_get_full_optimizer_state(params["fc2.weight"], "exp_avg"), new_m, "fp32", f"{label} exp_avg trip")

    def edit_before_step() -> None:
        # Full gradient.
        g = ref.p["fc2.bias"].grad * 3
        utils.safe_set_full_grad(params["fc2.bias"], g)
        ref.p["fc2.bias"].grad = g
        _close(utils.safe_get_full_grad(params["fc2.bias"]), g, precision, f"{label} grad round trip")
        # Local gradient: every rank halves its fragment.
        local = utils.safe_get_local_grad(params["fc1.weight"])
        assert local is not None
        utils.safe_set_local_grad(params["fc1.weight"], local * 0.5)
        ref.p["fc1.weight"].grad = ref.p["fc1.weight"].grad * 0.5
        _close(utils.safe_get_local_grad(params["fc1.weight"]), local * 0.5, precision, f"{label} local grad trip")
        # Vectorized update.
        utils.safe_update_full_grad_vectorized([params["ln.bias"], params["frozen"]], lambda grad, p: grad + 0.01)
        ref.p["ln.bias"].grad = ref.p["ln.bias"].grad + 0.01
        # Local fp32 param and optimizer state: every rank edits its fragment.
        w = utils.safe_get_local_fp32_param(params["ln.weight"])
        assert w is not None
        utils.safe_set_local_fp32_param(params["ln.weight"], w + 0.1)
        with torch.no_grad():
            ref.p["ln.weight"].add_(0.1)
        v = utils.safe_get_local_optimizer_state(params["fc1.bias"], "exp_avg_sq")
        assert v is not None
        utils.safe_set_local_optimizer_state(params["fc1.bias"], v * 1.5, "exp_avg_sq")
        ref.state("fc1.bias", "exp_avg_sq").mul_(1.5)
        with pytest.raises(ValueError, match="elements"):
            utils.safe_set_full_grad(params["fc2.bias"], torch.zeros(3))

    train_step(WARMUP, edit_before_step)
    train_step(WARMUP + 1, plain_boundary_backward=True)
    assert utils.safe_get_full_fp32_param(copy.deepcopy(params["fc2.bias"])) is None  # a copy has a dead link
    engine.destroy()
    assert not hasattr(params["fc1.weight"], "_ds_access")
    assert utils.safe_get_full_fp32_param(params["fc1.weight"]) is None
    return {"label": label}


def _combos(stage: int) -> list[tuple[str, bool]]:
    out = [("fp32", False), ("bf16", False)]
    if stage >= 2:
        out += [("fp32", True), ("bf16", True)]
    if stage in (1, 3):
        out.append(("fp16", False))
    return out


def _stage(rank: int, world: int, stage: int) -> list[dict[str, Any]]:
    return [_run(rank, world, stage, precision, offload) for precision, offload in _combos(stage)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_state_access_matches_reference(stage: int) -> None:
    results = run_distributed(_stage, world_size=WORLD, args=(stage,), timeout=300)
    assert [r["label"] for r in results[0]] == [f"stage {stage} {p} offload={o}" for p, o in _combos(stage)]
