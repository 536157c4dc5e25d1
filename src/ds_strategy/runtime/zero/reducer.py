"""The gradient reducer of stages 0-3: which bucket's collective goes next, what is in flight, which
gradients came late. The stage owns the gradients themselves (where each lands, how a bucket is reduced);
the reducer owns the schedule, driven by one state (``ReducerState``) instead of loose flags.

A reducing pass ([Note: gradient hooks and bucket order] in base.py): the stage reports every gradient's
arrival; once all the gradients a bucket expects are in, the bucket is complete and the buckets are
launched in ``bucket_order`` (the same on every rank) as far as complete ones reach, with at most
``max_inflight`` elements in flight. Late gradients ([Note: a hook that fires twice] in base.py) collect
per bucket and are reduced at the end of the pass.

[Note: one order of collectives on every rank]
Every collective the reducer causes is issued at a point every rank reaches in the same order: a bucket's
launch; the next step of a multi-step reduction (qgZ across nodes: its second all-to-all, see [Note: when
step 2 is issued] in comm/quantized_all_to_all.py), issued for every reduction in flight when the next
bucket is launched, and for the last ones at the end of the pass; and the waits that bound what is in
flight. Reductions land oldest first, so in the recorded bucket order on every rank. Only *when* a finished
reduction is folded in is left to ``is_completed()`` polling, which frees its buffers early: a handle that
still has a step to issue never reports completion, so polling never issues a collective (it once did:
qgZ's second all-to-all issued at a rank-dependent landing deadlocked 4 ranks in 2 nodes).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from ..layout import BucketKey
from .collectives import Handle, advance


class ReducerState(enum.Enum):
    """Where the accumulation window's gradients stand."""

    IDLE = "idle"  # outside backward, the window not reduced (empty, or accumulating over micro-steps)
    ACCUMULATING = "accumulating"  # inside a backward that does not end the window
    REDUCING = "reducing"  # a reducing pass: buckets are launched as they complete
    REDUCED = "reduced"  # the window's gradients are reduced (until zero_grad)


class BucketReduction(Protocol):
    """What a stage does for the reducer."""

    def launch_reduction(self, key: BucketKey) -> Handle:
        """Issue the collective of one bucket; the handle's wait() lands the result."""
        ...

    def bucket_complete(self, key: BucketKey) -> None:
        """Every gradient this pass expects for ``key`` has arrived."""
        ...

    def late_buffer(self, key: BucketKey) -> torch.Tensor:
        """A zeroed bucket-shaped buffer for gradients arriving after their bucket was launched."""
        ...

    def reduce_late(self, key: BucketKey, late: torch.Tensor) -> None:
        """Reduce ``late`` as the bucket was reduced and add the result to the bucket's."""
        ...


class GradientReducer:
    """The reduction schedule of one stage. ``bucket_pids``: each bucket's parameter ids (in ``bucket_order``'s
    keys); ``numel_of``: a bucket's elements in flight; ``every_backward``: the stage reduces in every backward
    (stages 0-1) rather than once per accumulation window."""

    def __init__(
        self,
        stage: BucketReduction,
        bucket_order: list[BucketKey],
        bucket_pids: dict[BucketKey, list[int]],
        numel_of: dict[BucketKey, int],
        max_inflight: int,
        *,
        every_backward: bool,
    ) -> None:
        self.stage, self.bucket_order, self.bucket_pids = stage, bucket_order, bucket_pids
        self.numel_of, self.max_inflight, self.every_backward = numel_of, max_inflight, every_backward
        self.state, self.in_backward = ReducerState.IDLE, False
        self.unmanaged = False  # a gradient arrived outside engine.backward since the last pass
        n = sum(len(p) for p in bucket_pids.values())
        # [Note: a hook that fires twice]: per parameter, the arrivals one reducing backward expects (learned
        # from the last one) and those seen in this one; late gradients per bucket.
        self.times = [1] * n
        self.count = [0] * n
        self.late: dict[BucketKey, torch.Tensor] = {}
        self._pending: dict[BucketKey, int] = {}
        self._launched: set[BucketKey] = set()
        self._next = 0  # position in bucket_order of the next bucket to launch
        self._inflight: list[tuple[Handle, int]] = []  # (reduction, its bucket's elements)
        self._inflight_numel = 0
        self._reduced_before = False  # the pass running started in a reduced window (stages 0-1 reduce again)

    # ------------------------------------------------------------------ state
    @property
    def reducing(self) -> bool:
        return self.state is ReducerState.REDUCING

    @property
    def reduced(self) -> bool:
        """The window went through a reducing pass (its gradients are reduced)."""
        return self.state is ReducerState.REDUCED or (self.reducing and self._reduced_before)

    def begin_backward(self, *, reduce: bool) -> None:
        """Before ``loss.backward()``; ``reduce``: this backward ends the window."""
        self.in_backward = True
        if reduce or self.every_backward:
            self.start_pass()
        elif self.state is ReducerState.IDLE:
            self.state = ReducerState.ACCUMULATING

    def end_backward(self) -> None:
        """After ``loss.backward()``: finish the reducing pass, if any."""
        self.in_backward = False
        if self.reducing:
            self.finish_pass()
        elif self.state is ReducerState.ACCUMULATING:
            self.state = ReducerState.IDLE

    def abandon_pass(self) -> None:
        """The backward raised: forget the pass and its reductions in flight, issuing and waiting for nothing
        (a peer may be gone); the window starts over at the next backward."""
        self.in_backward = False
        self._inflight.clear()
        self._inflight_numel = 0
        self.late.clear()
        self.state = ReducerState.IDLE
        self.unmanaged = False

    def catch_up(self) -> None:
        """Before the optimizer step: the window's gradients fully reduced, whatever ran before."""
        if self.reducing:
            self.finish_pass()
        if self.state is not ReducerState.REDUCED or self.unmanaged:
            self.start_pass()
            self.finish_pass()

    def reset(self) -> None:
        """zero_grad: a started pass is completed (ranks stay in step), then a new window."""
        if self.reducing:
            self.finish_pass()
        self.state = ReducerState.ACCUMULATING if self.in_backward else ReducerState.IDLE
        self.unmanaged = False

    # ------------------------------------------------------------------ arrivals
    def arrive(self, pid: int) -> bool:
        """Count an arrival of ``pid``'s gradient in a reducing pass; False when it is beyond the expected
        number ([Note: a hook that fires twice])."""
        self.count[pid] += 1
        return self.count[pid] <= self.times[pid]

    def launched(self, key: BucketKey) -> bool:
        return key in self._launched

    def through(self, key: BucketKey, pid: int) -> bool:
        """Every parameter of ``key`` has arrived as often as ``pid`` (an extra backward is through)."""
        return all(self.count[p] >= self.count[pid] for p in self.bucket_pids[key])

    def expected_arrived(self, key: BucketKey) -> None:
        """One expected gradient of ``key`` is in: at the last one the bucket is complete and launched in turn."""
        self._pending[key] -= 1
        if self._pending[key] == 0:
            self.stage.bucket_complete(key)
            self._launch_ready()

    def late_buffer_for(self, key: BucketKey) -> torch.Tensor:
        late = self.late.get(key)
        if late is None:
            late = self.late[key] = self.stage.late_buffer(key)
        return late

    # ------------------------------------------------------------------ the pass
    def start_pass(self) -> None:
        self._reduced_before = self.state is ReducerState.REDUCED
        self.state = ReducerState.REDUCING
        self._next = 0
        self._pending = {key: sum(self.times[p] for p in pids) for key, pids in self.bucket_pids.items()}
        self.count = [0] * len(self.count)
        self._launched.clear()
        self.late.clear()

    def _launch_ready(self) -> None:
        while self._next < len(self.bucket_order) and self._pending[self.bucket_order[self._next]] <= 0:
            self._launch_next()

    def _launch_next(self) -> None:
        key = self.bucket_order[self._next]
        self._launched.add(key)
        numel = self.numel_of[key]
        handle = self.stage.launch_reduction(key)
        # The reduction launched before this one takes its next step now (qgZ's second all-to-all), after
        # this launch so that its first step is queued behind theirs ([Note: one order of collectives on
        # every rank]); the older ones took theirs at their successor's launch (a step is issued once).
        if self._inflight:
            advance(self._inflight[-1][0])
        self._inflight.append((handle, numel))
        self._inflight_numel += numel
        self._next += 1
        # At most reduce_bucket_size elements in flight (their staging buffers with them), as DeepSpeed's
        # key promises: the oldest reduction lands before another starts. Collectives complete in launch
        # order on every rank, so waiting for the oldest never waits on a peer's later one.
        while len(self._inflight) > 1 and self._inflight_numel > self.max_inflight:
            self._land_oldest()
        # Reductions that already finished land now, so their staging buffers go at once rather than at
        # the end of backward: with DeepSpeed's default bucket size (5e8) every bucket would otherwise stay
        # until then, on top of the activations of the last blocks (a checkpointed backward's peak). A
        # finished reduction has nothing left to issue: landing it is local.
        while self._inflight and self._inflight[0][0].is_completed():
            self._land_oldest()

    def _land_oldest(self) -> None:
        handle, landed = self._inflight.pop(0)
        handle.wait()
        self._inflight_numel -= landed

    def finish_pass(self) -> None:
        while self._next < len(self.bucket_order):
            self._launch_next()
        for handle, _ in self._inflight:  # the last bucket's next step before any wait
            advance(handle)
        for handle, _ in self._inflight:
            handle.wait()
        self._inflight.clear()
        self._inflight_numel = 0
        for key, late in self.late.items():  # in bucket order on every rank: the same collectives
            self.stage.reduce_late(key, late)
        self.late.clear()
        self.times = [c if c > 0 else t for c, t in zip(self.count, self.times, strict=True)]
        self.state = ReducerState.REDUCED
        self.unmanaged = False
