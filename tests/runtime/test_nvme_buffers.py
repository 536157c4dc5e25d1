"""NVMe offload's host buffers are what a DeepSpeed config sizes (issue 47, criterion 3's memory):

- ``offload_optimizer.buffer_count`` counts tensors of a sub-group (DeepSpeed: "at least the number of
  states maintained per parameter by the optimizer"), so Adam at stage 3 (master, gradient, two moments)
  holds one tile per 4 buffers; pipelining needs two tiles, and a pipeline asked for with fewer is
  reported once (rank 0) and runs tile by tile, with the same weights;
- the unpinned pool goes back to the OS after each step (forward and backward do not use it);
- parameter read-ahead stays within ``offload_param.buffer_count`` x ``buffer_size`` elements (always the
  next partition).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.test_nvme_overlap import _config as overlap_config

LAYERS, WIDTH, STEPS = 5, 32, 3  # the overlap test's width: its partition sizes


def _config(path: str, opt_buffers: int) -> dict[str, Any]:
    """The overlap test's config (several tiles; 1056-element parameter partitions on one rank, 2 x 600-element
    read-ahead buffers: a budget of one partition ahead) with ``opt_buffers`` optimizer buffers."""
    cfg = overlap_config(path)
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = opt_buffers
    return cfg


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _run(rank: int, world: int, path: str, opt_buffers: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    records = _Records()
    logging.getLogger("ds_strategy").addHandler(records)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, _, _, _ = rt.initialize(model=model, model_parameters=model.parameters(), config=_config(path, opt_buffers))
    params, opt = engine.stage.swap.params, engine.stage.swap.optimizer
    live, peak_tiles, in_flight = [0], [0], []
    take, give = opt.pool.take, opt.pool.give

    def counted_take(nbytes: int) -> torch.Tensor:
        live[0] += 1
        peak_tiles[0] = max(peak_tiles[0], live[0])
        return take(nbytes)

    def counted_give(buf: torch.Tensor) -> None:
        live[0] -= 1
        give(buf)

    opt.pool.take, opt.pool.give = counted_take, counted_give  # type: ignore[method-assign]
    step_tiles = opt.step

    def logged_step(tiles: Any, run: Any) -> None:
        def logged(t: int) -> None:
            aio = opt.file.aio
            in_flight.append(aio.issued["read"] - aio.completed["read"])
            run(t)

        step_tiles(tiles, logged)

    opt.step = logged_step  # type: ignore[method-assign]
    ahead_peak = [0]
    load = params.load

    def watched_load(key: Any, out: torch.Tensor) -> None:
        load(key, out)
        ahead_peak[0] = max(ahead_peak[0], sum(params.numel[k] for k in params._ahead))

    params.load = watched_load  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        peak_tiles[0] = 0
        x = torch.randn(2, WIDTH, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    result = {
        "pool_count": opt.pool.count,
        "tiles_last_step": peak_tiles[0],
        "pool_after_step": (opt.pool.made, len(opt.pool.free)),
        "in_flight_last_step": in_flight[-len(engine.stage.stepper.tiles()) :],
        "ahead_peak": ahead_peak[0],
        "largest_partition": max(params.numel.values()),
        "budget": 2 * 600,
        "warnings": [m for m in records.messages if "buffer_count" in m],
        "weights": [p.detach().clone() for p in engine._zero3_consolidated_16bit_state_dict().values()],
    }
    engine.destroy()
    logging.getLogger("ds_strategy").removeHandler(records)
    return result


@pytest.mark.multiprocess
def test_optimizer_buffer_count_counts_tensors_and_read_ahead_stays_in_budget(tmp_path: Path) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    (one,) = run_distributed(_run, world_size=1, args=(str(tmp_path / "a"), 4), timeout=240)
    (two,) = run_distributed(_run, world_size=1, args=(str(tmp_path / "b"), 8), timeout=240)
    # 4 buffers = one tile of Adam's 4 tensors: no read ahead of the step, and the pipeline is reported once.
    assert one["pool_count"] == 1 and one["tiles_last_step"] == 1
    assert all(n == 0 for n in one["in_flight_last_step"]), one["in_flight_last_step"]
    assert len(one["warnings"]) == 1 and "buffer_count >= 8" in one["warnings"][0], one["warnings"]
    # 8 buffers = two tiles: the next tile's read is in flight while one steps (all but the last tile).
    assert two["pool_count"] == 2 and two["tiles_last_step"] == 2
    assert all(n > 0 for n in two["in_flight_last_step"][:-1]), two["in_flight_last_step"]
    assert not two["warnings"]
    # Unpinned (no CUDA here): the pool's buffers went back after the step.
    assert one["pool_after_step"] == (0, 0) and two["pool_after_step"] == (0, 0)
    # Read-ahead: within buffer_count x buffer_size elements, or the one next partition when it is larger.
    for r in (one, two):
        assert 0 < r["ahead_peak"] <= max(r["budget"], r["largest_partition"]), r
    # Same arithmetic either way.
    for a, b in zip(one["weights"], two["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
