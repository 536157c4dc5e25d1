"""Random-number state for recomputation: a checkpointed forward must draw the same dropout masks twice.

``capture()`` records the CPU generator and, when the inputs live on a CUDA device, that device's generator,
plus every state of the model-parallel tracker; ``restored(states)`` runs a block under them and puts the
caller's states back afterwards (recomputation happens in the middle of backward, whose own draws must not
shift). The tracker (``get_cuda_rng_tracker``) keeps named generator states beside the default one, as
Megatron / DeepSpeed do for model-parallel regions: ``with tracker.fork():`` draws from the named state and
advances it, leaving the default stream untouched. On a machine without CUDA the tracker works on the CPU
generator (the generator of the device the package computes on).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718  # DeepSpeed's offset between the data-parallel and the model-parallel seeds


def _device_generator_state(device: torch.device | None) -> torch.Tensor | None:
    if device is not None and device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return None


def _tracked_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of the tracked device (CUDA when available, else the CPU)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Start a named state from ``seed`` (both must be new, as in Megatron)."""
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker; each named state needs its own seed")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the RNG tracker; call reset() first")
        self.seeds.add(seed)
        device = _tracked_device()
        saved = _get_state(device)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(device)
        _set_state(device, saved)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the named state inside the block; the default stream is left where it was."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not in the tracker; add it first (tracker.add(name, seed))")
        device = _tracked_device()
        saved = _get_state(device)
        _set_state(device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(device)
            _set_state(device, saved)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (DeepSpeed's name; on a CPU-only machine it tracks the CPU generator)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, model_parallel_rank: int = 0) -> None:
    """Seed the default generator with ``seed`` (the same on every model-parallel rank) and the tracker's
    model-parallel state with ``seed + 2718 + model_parallel_rank`` (different per rank), as DeepSpeed does."""
    device = _tracked_device()
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET + model_parallel_rank)


@dataclass(frozen=True)
class RNGStates:
    cpu: torch.Tensor
    device: torch.device | None
    device_state: torch.Tensor | None
    tracker: dict[str, torch.Tensor]


def capture(device: torch.device | None) -> RNGStates:
    """The generator states a checkpointed forward starts from (``device``: where its inputs live)."""
    return RNGStates(torch.get_rng_state(), device, _device_generator_state(device), _TRACKER.get_states())


@contextmanager
def restored(states: RNGStates) -> Iterator[None]:
    """Run the block from ``states``; afterwards every generator is back where the caller had it."""
    now = capture(states.device)
    torch.set_rng_state(states.cpu)
    if states.device_state is not None and states.device is not None:
        torch.cuda.set_rng_state(states.device_state, states.device)
    _TRACKER.set_states(states.tracker)
    try:
        yield
    finally:
        torch.set_rng_state(now.cpu)
        if now.device_state is not None and now.device is not None:
            torch.cuda.set_rng_state(now.device_state, now.device)
        _TRACKER.set_states(now.tracker)
