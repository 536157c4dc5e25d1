"""``checkpoint`` (reentrant) and ``non_reentrant_checkpoint``: run a function without keeping its
activations, and run it again inside backward to get them back (DeepSpeed's two entry points).

[Note: reentrant vs non-reentrant]
The reentrant form is an autograd Function: its forward runs the function under no_grad and keeps only
the inputs (see stash.py); its backward reruns the function with grad and calls ``torch.autograd.backward``
on the recomputed outputs - a backward inside the backward. Gradients of parameters used inside therefore
arrive once per checkpointed call, in separate nested backward passes (the ZeRO stages learn how many,
see [Note: a hook that fires twice] in runtime/zero/base.py). Only ``loss.backward()`` works through it,
not ``torch.autograd.grad``, and at least one input must require grad for parameters to get gradients.
The non-reentrant form is torch's ``use_reentrant=False`` checkpoint (saved-tensor hooks: the
recomputation happens when backward first unpacks a dropped activation, within the same backward pass),
with the same input handling, random-state replay and boundaries added here.

Both replay the random state (CPU, the inputs' CUDA device, the model-parallel tracker) and autocast, so
dropout draws the same masks in the recomputation, and both honour ``synchronize`` (device sync at each
checkpoint boundary) and ``profile`` (timed forward and recomputation, ``profile_report()``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from ds_strategy.accelerator.spans import span

from . import rng
from .options import model_parallel, settings, tell_once
from .stash import Stash

_TIMES: dict[str, list[float]] = {"forward": [], "recompute": []}


def _device_of(args: tuple[Any, ...]) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), None)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        tell_once(
            "sync-on-cpu",
            "activation_checkpointing.synchronize_checkpoint_boundary waits for the device's queued kernels at "
            "each checkpoint boundary; CPU work is synchronous, so there is nothing to wait for here",
        )


@contextmanager
def _boundary(kind: str, device: torch.device | None) -> Iterator[None]:
    """A checkpoint's forward or recomputation: labelled for the profiler, synced and timed if asked."""
    s = settings()
    if s.synchronize:
        _sync(device)
    start = time.perf_counter()
    with span(f"ds::checkpoint_{kind}"):
        yield
    if s.synchronize:
        _sync(device)
    if s.profile:
        if device is not None and device.type == "cuda" and not s.synchronize:
            torch.cuda.synchronize(device)
        _TIMES[kind].append(time.perf_counter() - start)


def profile_report(*, reset: bool = True) -> dict[str, float]:
    """With ``profile`` on: checkpointed calls and total milliseconds of forwards and recomputations since
    the last report."""
    out = {
        "calls": float(len(_TIMES["forward"])),
        "forward_ms": 1000.0 * sum(_TIMES["forward"]),
        "recompute_ms": 1000.0 * sum(_TIMES["recompute"]),
    }
    if reset:
        for v in _TIMES.values():
            v.clear()
    return out


def _autocast_state(device: torch.device | None) -> Callable[[], Any]:
    """A factory for the autocast context active now, to re-enter it in the recomputation."""
    kind = device.type if device is not None else "cpu"
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return nullcontext
    dtype = torch.get_autocast_dtype(kind)
    return lambda: torch.autocast(kind, dtype=dtype)


class _Checkpoint(torch.autograd.Function):
    """The reentrant checkpoint (see the module note)."""

    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], *args: Any) -> Any:
        device = _device_of(args)
        ctx.function = function
        ctx.rng = rng.capture(device)
        ctx.autocast = _autocast_state(device)
        ctx.device = device
        with _boundary("forward", device), torch.no_grad():
            outputs = function(*args)
        stash = Stash(args, settings(), model_parallel())
        ctx.save_for_backward(*stash.plain)
        stash.drop_plain()
        ctx.stash = stash
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "ds_strategy.checkpointing.checkpoint (reentrant) works with loss.backward() / engine.backward(), "
                "not torch.autograd.grad; use non_reentrant_checkpoint for that"
            )
        stash: Stash = ctx.stash
        inputs = stash.restore(ctx.saved_tensors)
        inputs = [
            x.detach().requires_grad_(needs) if isinstance(x, torch.Tensor) else x
            for x, needs in zip(inputs, stash.requires_grad, strict=True)
        ]
        with rng.restored(ctx.rng), torch.enable_grad(), ctx.autocast(), _boundary("recompute", ctx.device):
            outputs = ctx.function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=False)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.stash = None
        return (None, *(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs))


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` keeping only its inputs; recompute it in backward (reentrant, DeepSpeed's
    ``deepspeed.checkpointing.checkpoint``). Returns what ``function`` returns (a tensor or a tuple)."""
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        tell_once(
            "no-grad-input",
            "a reentrant checkpoint got no input that requires grad: the parameters inside it get no gradient. "
            "Make an input require grad (e.g. x.requires_grad_() on the embeddings' output, or Hugging Face's "
            "model.enable_input_require_grads()), or use non_reentrant_checkpoint",
        )
    return _Checkpoint.apply(function, *args)


class _Replay:
    """The function torch's non-reentrant checkpoint runs: the first call uses the original inputs, the
    recomputation the stashed ones; inputs are kept by the stash only, so its options apply."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], stash: Stash) -> None:
        self.function, self.stash = function, stash
        self.args: tuple[Any, ...] | None = args

    def __call__(self, _anchor: torch.Tensor) -> Any:
        if self.args is not None:
            args, self.args = self.args, None  # dropped after the first forward
            with _boundary("forward", _anchor.device):
                return self.function(*args)
        inputs = self.stash.restore(self.stash.plain)
        # A rebuilt input must require grad as the original did, or the ops save other tensors than the
        # first forward did (torch's checkpoint checks they match).
        inputs = [
            x.requires_grad_(needs) if isinstance(x, torch.Tensor) and x.is_leaf and not x.requires_grad else x
            for x, needs in zip(inputs, self.stash.requires_grad, strict=True)
        ]
        with _boundary("recompute", _anchor.device):
            return self.function(*inputs)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Like ``checkpoint``, but built on saved-tensor hooks (torch's ``use_reentrant=False``): works with
    ``torch.autograd.grad``, with inputs that do not require grad, and with nested checkpoints."""
    device = _device_of(args) or torch.device("cpu")
    stash = Stash(args, settings(), model_parallel())
    anchor = torch.empty(0, device=device)  # tells torch the device whose random state to replay
    tracker = rng.get_cuda_rng_tracker().get_states()

    def contexts() -> tuple[Any, Any]:
        return nullcontext(), _tracker_replayed(tracker)

    return torch_checkpoint.checkpoint(_Replay(function, args, stash), anchor, use_reentrant=False, context_fn=contexts)


@contextmanager
def _tracker_replayed(states: dict[str, torch.Tensor]) -> Iterator[None]:
    tracker = rng.get_cuda_rng_tracker()
    now = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(now)
