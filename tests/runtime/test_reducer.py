"""runtime/zero/reducer.py on its own: the state a window goes through, and buckets launched strictly in the
agreed order (a complete bucket waits for the ones before it), whatever order gradients arrive in."""

from __future__ import annotations

import torch

from ds_strategy.runtime.zero.reducer import GradientReducer, ReducerState

ORDER = [(0, 2), (0, 1), (0, 0)]  # the agreed order: the reverse of registration, as backward completes them
PIDS = {(0, 0): [0], (0, 1): [1, 2], (0, 2): [3]}


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class _Stage:
    def __init__(self) -> None:
        self.launched: list[tuple[int, int]] = []
        self.complete: list[tuple[int, int]] = []
        self.late: list[tuple[int, int]] = []

    def launch_reduction(self, key: tuple[int, int]) -> _Done:
        self.launched.append(key)
        return _Done()

    def bucket_complete(self, key: tuple[int, int]) -> None:
        self.complete.append(key)

    def late_buffer(self, key: tuple[int, int]) -> torch.Tensor:
        return torch.zeros(4)

    def reduce_late(self, key: tuple[int, int], late: torch.Tensor) -> None:
        self.late.append(key)


def _reducer(every_backward: bool = False) -> tuple[GradientReducer, _Stage]:
    stage = _Stage()
    numel = {k: 4 for k in PIDS}
    return GradientReducer(stage, ORDER, PIDS, numel, 8, every_backward=every_backward), stage


def _arrive(reducer: GradientReducer, pid: int) -> None:
    key = next(k for k, pids in PIDS.items() if pid in pids)
    assert reducer.arrive(pid)
    reducer.expected_arrived(key)


def test_a_window_accumulates_then_reduces_in_the_agreed_order() -> None:
    reducer, stage = _reducer()
    assert reducer.state is ReducerState.IDLE
    reducer.begin_backward(reduce=False)
    assert reducer.state is ReducerState.ACCUMULATING and reducer.in_backward
    reducer.end_backward()
    assert reducer.state is ReducerState.IDLE and not stage.launched
    reducer.begin_backward(reduce=True)
    assert reducer.reducing
    _arrive(reducer, 0)  # bucket (0, 0) is complete but last in the order: it waits
    assert stage.complete == [(0, 0)] and stage.launched == []
    _arrive(reducer, 3)  # (0, 2) goes at once
    assert stage.launched == [(0, 2)]
    _arrive(reducer, 1)
    _arrive(reducer, 2)  # (0, 1) complete: it goes, and (0, 0) behind it
    assert stage.launched == [(0, 2), (0, 1), (0, 0)]
    reducer.end_backward()
    assert reducer.state is ReducerState.REDUCED and reducer.reduced and not reducer.in_backward
    reducer.catch_up()  # reduced already: nothing more
    assert stage.launched == ORDER
    reducer.reset()
    assert reducer.state is ReducerState.IDLE and not reducer.reduced


def test_catch_up_reduces_a_window_no_backward_reduced_and_late_gradients_go_last() -> None:
    reducer, stage = _reducer()
    reducer.unmanaged = True  # a gradient came outside engine.backward
    reducer.catch_up()
    assert stage.launched == ORDER and reducer.state is ReducerState.REDUCED and not reducer.unmanaged
    reducer.reset()
    stage.launched.clear()
    reducer.begin_backward(reduce=True)
    for pid in (3, 1, 2, 0):
        _arrive(reducer, pid)
    assert not reducer.arrive(3)  # a second arrival of a launched bucket's parameter: late
    assert reducer.launched((0, 2)) and reducer.through((0, 2), 3)
    reducer.late_buffer_for((0, 2)).add_(1.0)
    reducer.end_backward()
    assert stage.late == [(0, 2)] and reducer.times[3] == 2  # the next pass expects two arrivals


def test_stages_that_reduce_every_backward_stay_reduced_across_passes() -> None:
    reducer, stage = _reducer(every_backward=True)
    for _ in range(2):
        reducer.begin_backward(reduce=False)  # every backward reduces
        assert reducer.reducing
        for pid in range(4):
            _arrive(reducer, pid)
        reducer.end_backward()
        assert reducer.state is ReducerState.REDUCED
    assert stage.launched == ORDER + ORDER
