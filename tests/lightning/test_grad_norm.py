"""Lightning's gradient idiom under every stage: ``on_before_optimizer_step`` + ``grad_norm(self, norm_type=2)``.

A LightningModule overrides ``on_before_optimizer_step``, records ``lightning.pytorch.utilities.grad_norm``
(per-parameter 2-norms and the total) and then edits the gradients in place (halves them, as a custom
clipping rule would). The same run under Lightning's DDP is the reference: the recorded norms must be
DDP's at every optimizer step (full, averaged, unscaled gradients as ``p.grad``, also where stage 3's
``p.data`` is a 0-element placeholder), and the final weights must be DDP's (the in-hook edit reached the
engine's step). Accumulation 2 and ``gradient_clip_val`` between the steps' norms, as in test_trainer.py.
Another module (not overriding the hook) checks that ``p.grad`` stays None for the engine's own callbacks.

Tolerances (fp32): norms rtol 1e-5, weights atol 1e-6 (test_trainer.py's; the engine averages with its
own collectives, DDP with its reducer: the same sums rounded in other places).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, LitNet, make_strategy

pytestmark = pytest.mark.multiprocess

CLIP = 4.5
EDIT = 0.5  # what the hook multiplies every gradient by


class GradNormNet(LitNet):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.norms: list[dict[str, float]] = []
        self.grad_shapes: dict[str, tuple[int, ...]] = {}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})
        for name, p in self.named_parameters():
            assert p.grad is not None, name
            self.grad_shapes[name] = tuple(p.grad.shape)  # stage 3 sharded: p.shape is the placeholder's
            p.grad.mul_(EDIT)


def _fit(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    saved_env = dict(os.environ)
    try:
        import lightning.pytorch as pl

        import ds_strategy.lightning  # noqa: F401  - registers the names in this worker
        from ds_strategy.zero import GatheredParameters

        pl.seed_everything(0, verbose=False)
        model = GradNormNet(optimizer="sgd", lr=0.1)
        trainer = pl.Trainer(
            strategy=make_strategy(strategy),
            accelerator="cpu",
            devices=world_size,
            max_epochs=1,
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        trainer.fit(model)
        with GatheredParameters(list(model.parameters())):
            weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        return {"norms": model.norms, "shapes": model.grad_shapes, "weights": weights}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _run(strategy: str) -> list[dict[str, Any]]:
    return run_distributed(_fit, 2, args=(strategy,), env=ELASTIC_ENV, init_process_group=False)


@pytest.fixture(scope="module")
def ddp() -> list[dict[str, Any]]:
    return _run("ddp")


@pytest.mark.parametrize(
    "name", ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_sharded", "zero3_offload"]
)
def test_grad_norm_in_on_before_optimizer_step_matches_ddp(name: str, ddp: list[dict[str, Any]]) -> None:
    runs = _run(name)
    for got, ref in zip(runs, ddp, strict=True):
        assert len(ref["norms"]) == 4  # 16 micro-batches per rank... / accumulation 2 = 4 optimizer steps
        assert len(got["norms"]) == len(ref["norms"])
        assert got["shapes"] == {k: tuple(w.shape) for k, w in ref["weights"].items()}
        assert max(n["grad_2.0_norm_total"] for n in ref["norms"]) > CLIP * EDIT  # some steps clip
        for step, (g, r) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
            assert g.keys() == r.keys(), step
            for key, value in r.items():
                assert g[key] == pytest.approx(value, rel=1e-5, abs=1e-7), f"step {step} {key}"
        for key, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][key], w, rtol=0, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def _count_windows(rank: int, world_size: int, with_callback: bool) -> tuple[int, int]:
    """(gradient windows opened, optimizer steps) for a module that does not override the hook, with or
    without a callback that does."""
    saved_env = dict(os.environ)
    from ds_strategy.runtime.zero.access import FullStateAccess

    original = FullStateAccess.visible_grads
    opened = [0]

    def counting(self: FullStateAccess) -> Any:
        opened[0] += 1
        return original(self)

    FullStateAccess.visible_grads = counting  # type: ignore[method-assign]
    try:
        import lightning.pytorch as pl

        import ds_strategy.lightning  # noqa: F401

        class SeesGrads(pl.Callback):
            def __init__(self) -> None:
                self.seen = 0

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                self.seen += all(p.grad is not None for p in pl_module.parameters())

        callback = SeesGrads()
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            strategy="zero2",
            accelerator="cpu",
            devices=world_size,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            callbacks=[callback] if with_callback else [],
        )
        trainer.fit(LitNet())
        if with_callback:
            assert callback.seen == trainer.global_step
        return opened[0], trainer.global_step
    finally:
        FullStateAccess.visible_grads = original  # type: ignore[method-assign]
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.mark.parametrize("with_callback", [False, True])
def test_gradients_shown_only_when_the_hook_is_overridden(with_callback: bool) -> None:
    for opened, steps in run_distributed(
        _count_windows, 2, args=(with_callback,), env=ELASTIC_ENV, init_process_group=False
    ):
        assert steps == 8
        assert opened == (steps if with_callback else 0)
