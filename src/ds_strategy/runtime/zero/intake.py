"""Gradient intake: the per-parameter gradient hooks and what arrived in the current accumulation window.

A stage owns its buffers and reductions; the intake owns the hooks that move autograd's gradients into
them ([Note: gradient hooks and bucket order] in base.py) and the per-parameter arrival state the rest
reads: which parameters were written since their bucket last left (``written``), which got a gradient in
this window (``got_grad``), and - outside a reducing pass - which buckets are complete (stage 3 frees a
bucket's gathered parameters then). It tells the reducer (reducer.py) about every arrival of a reducing
pass and the stage (``IntakeStage``) where a gradient goes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..layout import BucketKey
from .buffers import GroupStorage
from .reducer import GradientReducer


class GradStatus(enum.Enum):
    """Where the current accumulation window's gradients stand (``GradientIntake.status``)."""

    IN_BACKWARD = "a backward is running"
    NONE = "no gradient since the last step"
    PENDING = "accumulated, not reduced yet"  # stages 0-1 inside a window; a backward outside engine.backward
    REDUCED = "reduced"  # the boundary backward reduced them (stages 2-3: every backward does)


class IntakeStage(Protocol):
    """What the intake needs from its stage."""

    groups: list[GroupStorage]
    reduces_every_backward: bool

    def grad_target(self, group: int, index: int) -> torch.Tensor:
        """Where parameter ``index`` of ``group`` accumulates its gradient."""
        ...

    def bucket_complete(self, key: BucketKey) -> None:
        """Every gradient expected for ``key`` has arrived."""
        ...


class GradientIntake:
    """The gradient hooks of one stage's trainable parameters and their arrival state."""

    def __init__(self, stage: IntakeStage, reducer: GradientReducer, *, count_buckets: bool = False) -> None:
        self.stage = stage
        self.reducer = reducer
        groups = stage.groups
        # Per parameter id (``pid``, numbered group by group in layout order): (group, index in layout).
        self.where: list[tuple[int, int]] = [(g, i) for g, gs in enumerate(groups) for i in range(len(gs.params))]
        self._first_pid = [sum(len(gs.params) for gs in groups[:g]) for g in range(len(groups))]
        self._params: list[nn.Parameter] = [groups[g].params[i] for g, i in self.where]
        self.written = [False] * len(self._params)  # since its bucket buffer was last consumed
        self.got_grad = [False] * len(self._params)  # in this accumulation window (ignore_unused_parameters)
        self._hooks: list[RemovableHandle] = []
        # Outside a reducing pass nothing reports a complete bucket; a stage that frees gathered parameters
        # per bucket (stage 3) has the intake count arrivals instead.
        self._count_buckets = count_buckets
        self._bucket_grads: dict[BucketKey, int] = {}

    def pid(self, group: int, index: int) -> int:
        return self._first_pid[group] + index

    def attach(self) -> None:
        for pid, p in enumerate(self._params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(pid)))

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _hook_for(self, pid: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if torch.is_grad_enabled():  # backward(create_graph=True); a plain backward runs without grad mode
                with torch.no_grad():
                    self._on_grad(pid, param)
            else:  # no decorator: a no_grad context per gradient costs microseconds in the autograd thread
                self._on_grad(pid, param)

        return hook

    def _on_grad(self, pid: int, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if grad.layout != torch.strided:  # nn.Embedding(sparse=True): the flat buffers hold dense gradients
            grad = grad.to_dense()
        g, i = self.where[pid]
        groups = self.stage.groups
        reducer = self.reducer
        if reducer.reduced and not self.stage.reduces_every_backward:
            raise RuntimeError(
                f"a gradient for {groups[g].names[i]!r} arrived after this step's gradients were already "
                "reduced; call engine.step() after the boundary backward before running another backward. To "
                "accumulate several backwards into one step, make the earlier ones non-boundary: the config's "
                "gradient_accumulation_steps (the engine counts them), engine.no_sync(), or under Fabric "
                "`with fabric.no_backward_sync(model):` around each backward but the last"
            )
        if not reducer.in_backward:
            reducer.unmanaged = True
        key = (g, groups[g].layout.params[i].bucket)
        expected = True
        if reducer.reducing:
            expected = reducer.arrive(pid)
            if not expected and reducer.launched(key):
                self._add_late(key, g, i, grad)
                if reducer.through(key, pid):
                    self.stage.bucket_complete(key)  # every parameter of the bucket is through this extra backward
                return
        self.got_grad[pid] = True
        target = self.stage.grad_target(g, i)
        if self.written[pid]:
            target.add_(grad.view_as(target))
        else:
            target.copy_(grad.view_as(target))
            self.written[pid] = True
        if reducer.reducing:
            if expected:
                reducer.expected_arrived(key)  # the reducer calls bucket_complete when it launches the bucket
        elif self._count_buckets:
            count = self._bucket_grads[key] = self._bucket_grads.get(key, 0) + 1
            if count == len(groups[g].layout.buckets[key[1]].params):
                self.stage.bucket_complete(key)

    def _add_late(self, key: BucketKey, g: int, i: int, grad: torch.Tensor) -> None:
        """[Note: a hook that fires twice] Reentrant activation checkpointing runs one backward per
        checkpointed call, so a parameter used in two of them (a shared layer, a block called twice) gets
        its hook once per call. The pass expects as many calls as the last reducing backward had; a call
        beyond that whose bucket was already launched is kept here and reduced on its own at the end of the
        pass (the reductions are linear: reduce(a) + reduce(b) = reduce(a + b)). The next pass expects the
        new count and reduces the bucket once, after its last call."""
        layout = self.stage.groups[g].layout
        slot, bucket = layout.params[i], layout.buckets[layout.params[i].bucket]
        late = self.reducer.late_buffer_for(key)
        late[slot.offset - bucket.start : slot.end - bucket.start].add_(grad.reshape(-1).to(late.dtype))

    def end_backward(self) -> None:
        self._bucket_grads.clear()

    def consume(self, key: BucketKey, buffer: torch.Tensor) -> None:
        """Bucket ``key``'s buffer leaves for its reduction: zero the parts whose parameters got no gradient
        in this window, and start the bucket's parameters afresh (their next gradient is copied in)."""
        self.zero_unwritten(key, buffer)
        g, b = key
        for i in self.stage.groups[g].layout.buckets[b].params:
            self.written[self.pid(g, i)] = False

    def zero_unwritten(self, key: BucketKey, buffer: torch.Tensor) -> None:
        """Zero the parts of a bucket-shaped buffer whose parameters got no gradient in this window."""
        g, b = key
        layout = self.stage.groups[g].layout
        start = layout.buckets[b].start
        for i in layout.buckets[b].params:
            if not self.written[self.pid(g, i)]:
                slot = layout.params[i]
                buffer[slot.offset - start : slot.end - start].zero_()

    def status(self) -> GradStatus:
        """Where this window's gradients stand (read by the full-state access of ``access.py``)."""
        if self.reducer.in_backward:
            return GradStatus.IN_BACKWARD
        if not any(self.got_grad):
            return GradStatus.NONE
        if self.reducer.unmanaged or (not self.stage.reduces_every_backward and not self.reducer.reduced):
            return GradStatus.PENDING
        return GradStatus.REDUCED

    def parameters_without_gradient(self) -> list[str]:
        """Names of trainable parameters that got no gradient in the current accumulation window."""
        groups = self.stage.groups
        return [groups[g].names[i] for pid, (g, i) in enumerate(self.where) if not self.got_grad[pid]]

    def reset(self) -> None:
        """A new accumulation window: nothing written, nothing arrived."""
        self.written = [False] * len(self._params)
        self.got_grad = [False] * len(self._params)
        self._bucket_grads.clear()
