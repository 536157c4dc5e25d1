"""The order in which a tune tries its candidates: grid, random, or model-based (``autotuning.tuner_type``).

Every tuner is deterministic given the results so far, so all ranks pick the same next candidate without
talking (the results themselves are agreed: [Note: failing together] in trial.py).

- ``gridsearch``: the candidates in the space's order.
- ``random``: a shuffle of them (a fixed seed: the same on every rank and every run).
- ``model_based``: first one probe per (stage, offload, checkpointing) group at its largest micro batch that
  is predicted to fit - the groups without offload or checkpointing first, as those trade speed for memory
  and win only where the others do not fit - then, repeatedly, the untried candidate a cost model predicts
  to score best. The model
  is a least-squares fit of log(score) on the candidate's knobs (one-hot stage and offloads, checkpointing,
  log2 of the micro batch, the non-fast knobs as present / absent) over the trials that fitted. A trial that
  did not fit marks every candidate of its group with a larger or equal micro batch as not fitting.

Early stopping (``tuner_early_stopping``): once a candidate has fitted, the tune ends after that many trials
in a row that did not improve the best score (one that did not fit counts); while nothing fits the search
goes on (under a tight memory cap the first fitting candidate may come late). ``tuner_num_trials`` bounds
the trials run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from .space import Candidate

TUNER_TYPES = ("gridsearch", "random", "model_based")


class Tuner:
    """Hands out candidates; told each result through ``record``."""

    def __init__(self, candidates: Sequence[Candidate], *, seed: int = 0) -> None:
        self.pending = list(candidates)
        self.scores: dict[Candidate, float] = {}  # higher is better
        self.too_big: set[Candidate] = set()

    def record(self, candidate: Candidate, score: float | None) -> None:
        """``score`` None: the candidate did not fit (larger micro batches of its group are skipped too)."""
        if score is None:
            group = candidate.group
            self.too_big |= {c for c in self.pending if c.group == group and c.micro_batch >= candidate.micro_batch}
        else:
            self.scores[candidate] = score

    def next(self) -> Candidate | None:
        while self.pending:
            candidate = self._pick()
            self.pending.remove(candidate)
            if candidate not in self.too_big:
                return candidate
        return None

    def _pick(self) -> Candidate:
        return self.pending[0]


class RandomTuner(Tuner):
    def __init__(self, candidates: Sequence[Candidate], *, seed: int = 0) -> None:
        super().__init__(candidates, seed=seed)
        random.Random(seed).shuffle(self.pending)


class ModelBasedTuner(Tuner):
    """See the module docstring."""

    def __init__(self, candidates: Sequence[Candidate], *, seed: int = 0) -> None:
        super().__init__(candidates, seed=seed)
        largest: dict[tuple[object, ...], Candidate] = {}
        for c in self.pending:
            group = c.group
            if group not in largest or c.micro_batch > largest[group].micro_batch:
                largest[group] = c
        self.probes = sorted(largest.values(), key=_memory_trades)

    def _pick(self) -> Candidate:
        while self.probes:
            probe = self.probes.pop(0)
            if probe in self.pending and probe not in self.too_big:
                return probe
        usable = [c for c in self.pending if c not in self.too_big] or self.pending
        if len(self.scores) < 2:
            return max(usable, key=lambda c: c.micro_batch)
        weights = _fit(list(self.scores), [math.log(max(s, 1e-30)) for s in self.scores.values()])
        return max(usable, key=lambda c: float(_features(c) @ weights))


def _memory_trades(c: Candidate) -> tuple[int, int]:
    """How much speed a candidate trades for memory (checkpointing recomputes, offload copies): probe order."""
    return (
        int(c.activation_checkpointing) + int(c.offload_optimizer != "none") + int(c.offload_param != "none"),
        c.stage,
    )


def make_tuner(kind: str, candidates: Sequence[Candidate], *, seed: int = 0) -> Tuner:
    if kind in ("gridsearch", "grid"):
        return Tuner(candidates, seed=seed)
    if kind == "random":
        return RandomTuner(candidates, seed=seed)
    if kind == "model_based":
        return ModelBasedTuner(candidates, seed=seed)
    raise ValueError(f"autotuning.tuner_type: got {kind!r}; expected one of {', '.join(TUNER_TYPES)}")


def _features(c: Candidate) -> torch.Tensor:
    values = [
        1.0,
        *(1.0 if c.stage == s else 0.0 for s in (1, 2, 3)),
        1.0 if c.offload_optimizer != "none" else 0.0,
        1.0 if c.offload_param != "none" else 0.0,
        1.0 if c.activation_checkpointing else 0.0,
        math.log2(c.micro_batch),
        1.0 if c.reduce_bucket_size is not None else 0.0,
        1.0 if c.allgather_bucket_size is not None else 0.0,
        1.0 if c.overlap_comm is False else 0.0,
        1.0 if c.stage3_prefetch_bucket_size is not None else 0.0,
        1.0 if c.stage3_max_live_parameters is not None else 0.0,
    ]
    return torch.tensor(values, dtype=torch.float64)


def _fit(tried: Sequence[Candidate], targets: Sequence[float]) -> torch.Tensor:
    """Ridge-regularised least squares (a small ridge keeps it defined with fewer trials than features)."""
    x = torch.stack([_features(c) for c in tried])
    y = torch.tensor(targets, dtype=torch.float64)
    ridge = 1e-3 * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.solve(x.T @ x + ridge, x.T @ y)


class EarlyStop:
    """Counts trials since the best score last improved (``tuner_early_stopping``)."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.best: float | None = None
        self.since = 0

    def update(self, score: float | None) -> bool:
        """Record a trial's score (None: it did not fit); True when the tune should stop."""
        if score is not None and (self.best is None or score > self.best):
            self.best, self.since = score, 0
        elif self.best is not None:  # nothing fitted yet: keep searching
            self.since += 1
        return self.patience > 0 and self.since >= self.patience
