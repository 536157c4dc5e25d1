"""``Trainer(strategy=ZeroStrategy(compile=...))``: the engine compiles the LightningModule (stages 0-2 its
forward, stage 3 its blocks) without the user wrapping it, and fit trains as the eager strategy does.

Backend "aot_eager": the dynamo graphs and AOTAutograd's compiled backward without inductor's code
generation (minutes on 2 cores; inductor is covered in tests/runtime/test_compile.py). Tolerances: losses
rtol 1e-5, weights atol 1e-6, as tests/lightning/test_trainer.py (observed: identical).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ds_strategy.lightning as zl
from tests.harness import run_distributed
from tests.lightning.common import ELASTIC_ENV, fit_run

pytestmark = pytest.mark.multiprocess

TRAINER = {"accumulate_grad_batches": 2, "max_epochs": 1}
MODEL = {"optimizer": "sgd", "lr": 0.1}
SHARDED = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _fit(strategy: Any) -> list[dict[str, Any]]:
    return run_distributed(fit_run, 2, args=(strategy, TRAINER, MODEL), env=ELASTIC_ENV, init_process_group=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_compiled_fit_matches_eager(stage: int) -> None:
    eager = _fit(zl.ZeroStrategy(stage=stage, config=SHARDED))  # type: ignore[arg-type]
    compiled = _fit(zl.ZeroStrategy(stage=stage, config=SHARDED, compile={"backend": "aot_eager"}))  # type: ignore[arg-type]
    for got, ref in zip(compiled, eager, strict=True):
        assert got["engine"]["is_compiled"] and not ref["engine"]["is_compiled"]
        assert len(got["losses"]) == len(ref["losses"]) > 0
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        for name, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=0, atol=1e-6, msg=f"weight {name}")
