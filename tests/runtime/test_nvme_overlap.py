"""NVMe offload overlaps its I/O with compute (issue 47, criterion 2), proved without timing: the aio
engines' event logs (``AsyncIO.events``: each request's issue, and its completion when waited for) are
interleaved with the compute (module forwards, optimizer tile steps) in one log, and the order says

- parameter partitions: after the first step every gather's read was issued ahead (none on demand), the
  read of unit k+1 before the forward of unit k ends, and a forward ran while it was in flight;
- optimizer tiles: while a tile steps, the next tile's reads are in flight;
- writes (the step's updated partitions, the stepped tiles) are issued and left in flight while the step
  goes on, and each completes before its file region is read again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.runtime.common import config

LAYERS, WIDTH, STEPS = 6, 32, 4
STEADY = 2  # the first step records the order, the second re-records it (see the test)
Event = tuple[str, str, str, int]


def _config(path: str) -> dict[str, Any]:
    cfg = config(stage=3, offload=True, micro=2, gas=1)
    zero = cfg["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = 10
    zero["sub_group_size"] = 1200  # several tiles
    zero["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": path,
        "buffer_count": 12,  # tensors, as in DeepSpeed: three tiles of master, gradient and two Adam moments
        "pipeline_read": True,
        "pipeline_write": True,
    }
    # 600 elements per buffer: one rank's 1056-element partitions take buffers of their own, two ranks'
    # 528-element ones the pooled buffers; both are read ahead.
    zero["offload_param"] = {
        "device": "nvme",
        "nvme_path": path,
        "buffer_count": 2,
        "buffer_size": 600,
        "max_in_cpu": 0,
    }
    cfg["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}
    return cfg


def _run(rank: int, world: int, path: str) -> dict[str, Any]:
    import ds_strategy.runtime as rt

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, _, _, _ = rt.initialize(model=model, model_parameters=model.parameters(), config=_config(path))
    swap = engine.stage.swap
    params, opt = swap.params, swap.optimizer
    log: list[Event] = []
    params.file.aio.events = log
    opt.file.aio.events = log
    for i, layer in enumerate(model):  # registered after the engine's gather hooks: logged around the compute
        layer.register_forward_pre_hook(lambda m, a, i=i: log.append(("forward_start", str(i), "", 0)))
        layer.register_forward_hook(lambda m, a, o, i=i: log.append(("forward_end", str(i), "", 0)))
    in_flight: list[int] = []  # optimizer reads issued and not yet waited for, as each tile starts its step
    step_tiles = opt.step

    def logged_step(tiles: Any, run: Any) -> None:
        def logged(t: int) -> None:
            aio = opt.file.aio
            in_flight.append(aio.issued["read"] - aio.completed["read"] if t + 1 < len(tiles) else -1)
            log.append(("step_start", str(t), "", 0))
            run(t)
            log.append(("step_end", str(t), "", 0))

        step_tiles(tiles, logged)

    opt.step = logged_step  # type: ignore[method-assign]
    # The swap keys of each layer's unit: (group, bucket), as the gatherer names them.
    units = [list(engine.stage.gatherer.units[id(layer)]) for layer in model]
    offsets = {key: params.file.regions[key][0] for unit in units for key in unit if key in params.file.regions}
    g = torch.Generator().manual_seed(rank)
    marks = []
    for _ in range(STEPS):
        marks.append((len(log), params.reads_on_demand))
        x = torch.randn(2, WIDTH, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    marks.append((len(log), params.reads_on_demand))
    result = {
        "log": log,
        "marks": marks,
        "units": [[offsets[k] for k in unit if k in offsets] for unit in units],
        "params_path": params.file.file.path,
        "opt_path": opt.file.file.path,
        "in_flight": in_flight,
    }
    engine.destroy()
    return result


def _index(log: list[Event], start: int, end: int, event: Event) -> int:
    return next(i for i in range(start, end) if log[i] == event)


def _check(result: dict[str, Any]) -> None:
    log, marks, units = result["log"], result["marks"], result["units"]
    ppath, opath = result["params_path"], result["opt_path"]
    assert all(units[1:]), "every layer but maybe the first rests in the swap file"
    # The first step records the gather order; the second keeps the last blocks gathered for the backward
    # (the prefetch planner's reuse, which needs the record), so it skips keys of the first's order and its
    # first gather after the skip reads on demand; from the third on the order repeats exactly.
    for step in range(STEADY, STEPS):
        start, demand = marks[step]
        end, demand_after = marks[step + 1]
        assert demand_after == demand, f"step {step}: a gather read on demand"
        for k in range(LAYERS - 1):
            fwd_end = _index(log, start, end, ("forward_end", str(k), "", 0))
            for offset in units[k + 1]:
                # the read this forward uses was issued before unit k's forward ended (after the last step's
                # optimizer step at the earliest), ...
                reads = [i for i in range(marks[step - 1][0], fwd_end) if log[i] == ("issue", "read", ppath, offset)]
                assert reads, f"step {step}: unit {k + 1}'s read not issued before unit {k}'s forward ended"
                issued = reads[-1]
                done = _index(log, issued, end, ("done", "read", ppath, offset))
                assert start <= done < fwd_end, (step, k + 1, issued, done, fwd_end)
                if k + 1 >= 2:  # ... and a forward ran while it was in flight
                    assert any(e[0].startswith("forward") for e in log[issued:done]), (step, k + 1, log[issued:done])
    # Optimizer: the next tile's reads in flight while a tile steps (every tile but the last, every step).
    inner = [n for n in result["in_flight"] if n >= 0]
    assert inner and all(n > 0 for n in inner), str(result["in_flight"])
    # Writes: issued behind (another compute event before they complete), complete before the next read.
    behind = {ppath: 0, opath: 0}
    pending: dict[tuple[str, int], int] = {}
    for i, (phase, op, path, offset) in enumerate(log):
        if op == "write" and phase == "issue":
            pending[(path, offset)] = i
        elif op == "write" and phase == "done":
            issued = pending.pop((path, offset), -1)
            if issued < 0:  # issued before the log started (the engine's set-up)
                continue
            behind[path] += any(e[0] in ("step_start", "forward_start") for e in log[issued:i])
        elif op == "read" and phase == "issue":
            assert (path, offset) not in pending, f"{path}@{offset} read while its write is in flight"
    assert behind[ppath] > 0 and behind[opath] > 0, behind


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_nvme_reads_are_issued_ahead_and_writes_behind(world: int, tmp_path: Path) -> None:
    for result in run_distributed(_run, world_size=world, args=(str(tmp_path),), timeout=240):
        _check(result)
