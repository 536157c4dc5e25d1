"""Every phase of a ZeRO step carries a ``torch.profiler.record_function`` label (issue 19), so a profiler
trace reads like an FSDP2 one: ``ds::forward``, ``ds::backward``, ``ds::reduce_scatter`` / ``ds::all_reduce``,
``ds::grad_norm``, ``ds::optimizer_step``, ``ds::all_gather``, and at stage 3 ``ds::gather[<module>]``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import run_distributed
from tests.runtime.common import config, engine_run, make_tied, token_batches


def _labels(rank: int, world: int, stage: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    import ds_strategy.runtime as rt

    cfg: dict[str, Any] = config(stage=stage)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, _, _, _ = rt.initialize(model=make_tied(), config=cfg)
    data = token_batches(1, 2 * 2 * world)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine_run(engine, data, micro=2, gas=2)
    engine.destroy()
    return sorted({e.name for e in prof.events() if e.name.startswith("ds::")})


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, {"ds::all_reduce"}),
        (2, {"ds::reduce_scatter", "ds::all_gather"}),
        (3, {"ds::reduce_scatter", "ds::gather[embed]", "ds::gather[block.0]", "ds::gather[GatheredParameters]"}),
    ],
)
def test_every_phase_is_labelled(stage: int, expected: set[str]) -> None:
    names = set(run_distributed(_labels, world_size=2, args=(stage,))[0])
    common = {"ds::forward", "ds::backward", "ds::step", "ds::grad_norm", "ds::optimizer_step"}
    missing = (common | expected) - names
    assert not missing, f"missing {sorted(missing)}; recorded {sorted(names)}"
