"""What the trials teach the tune while it runs: a memory model corrected by the peaks measured so far, and a
second run of the best trials so that timing noise does not pick the winner.

[Note: the calibrated memory model]
The memory model (runtime/memory.py) counts model states, saved activations, gathered units and buckets. A
trial also holds what it does not count: autograd's transient gradients, the logits' softmax, the gloo
emulation of a reduce-scatter (a whole bucket per rank), recomputation under checkpointing. On 2 CPU ranks
the measured peak was 1.14x to 2.0x the prediction (benchmarks/results/autotune_gpt_run4.json), so a cap
below the model's DDP footprint let many candidates through that then ran and went over it. Every trial
run measures ``peak / predicted``; the smallest ratio seen in the candidate's family (same stage, offloads
and checkpointing: what sets the shape of its memory), or of all trials while the family has none, times
a 5% margin, scales the prediction of every candidate still to run. A candidate whose scaled prediction is
over the cap is skipped as "over the cap (calibrated)". The ratio is a floor of what was measured, so the
rule can only skip a fitting candidate if that candidate's unmodelled memory were smaller, by more than the
margin, than every one measured in its family. Every rank agrees on the trials' peaks, so every rank skips
alike.

[Note: confirming the best]
Two trials of configurations that are equally fast differ by a few percent from run to run on a busy
machine (the winner of the e2e GPT flipped between two runs of the benchmark). After the search the
``confirm_top`` best fitted trials run once more; each is then ranked by the mean step time of both runs,
and one that goes over the cap in its second run does not fit.
"""

from __future__ import annotations

from dataclasses import replace

from .space import Candidate
from .trial import OK, OUT_OF_MEMORY, OVER_CAP, TrialResult

CALIBRATED = "over the cap (calibrated)"
MARGIN = 0.95  # the scaled prediction must clear the cap by 5% before a candidate is skipped


def family(c: Candidate) -> tuple[object, ...]:
    """What decides the shape of a candidate's memory (its knobs but the micro batch and the buckets)."""
    return (c.stage, c.offload_optimizer, c.offload_param, c.activation_checkpointing)


class Calibration:
    """The measured floor of ``peak / predicted`` per family (see [Note: the calibrated memory model])."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.ratios: dict[tuple[object, ...], float] = {}

    def learn(self, trial: TrialResult) -> None:
        """Take a run trial's measured peak (fitted or over the cap: both measured what they held)."""
        if trial.status not in (OK, OVER_CAP, OUT_OF_MEMORY) or not trial.peak_bytes or not trial.predicted_bytes:
            return
        key = family(trial.candidate)
        ratio = trial.peak_bytes / trial.predicted_bytes
        self.ratios[key] = min(self.ratios.get(key, ratio), ratio)

    def ratio(self, c: Candidate) -> float | None:
        """The floor for ``c``'s family, else of every trial so far (None before the first)."""
        if not self.ratios:
            return None
        return self.ratios.get(family(c), min(self.ratios.values()))

    def expected(self, c: Candidate, predicted: int) -> int | None:
        """The prediction scaled by the floor and the margin (None while nothing was measured)."""
        ratio = self.ratio(c)
        return None if ratio is None else int(predicted * ratio * MARGIN)

    def rules_out(self, c: Candidate, predicted: int) -> bool:
        expected = self.expected(c, predicted)
        return self.cap is not None and expected is not None and expected > self.cap


def combine(first: TrialResult, again: TrialResult) -> TrialResult:
    """One trial from two runs of the same candidate (see [Note: confirming the best])."""
    if not again.fits or again.step_s is None or first.step_s is None:
        return replace(again, predicted_bytes=first.predicted_bytes, wall_s=first.wall_s + again.wall_s)
    step_s = (first.step_s + again.step_s) / 2
    scale = first.step_s / step_s
    return replace(
        first,
        step_s=step_s,
        samples_per_s=None if first.samples_per_s is None else first.samples_per_s * scale,
        flops_per_s=None if first.flops_per_s is None else first.flops_per_s * scale,
        mfu=None if first.mfu is None else first.mfu * scale,
        peak_bytes=max(first.peak_bytes or 0, again.peak_bytes or 0),
        wall_s=first.wall_s + again.wall_s,
        step_times=first.step_times + again.step_times,
        runs=first.runs + again.runs,
    )
