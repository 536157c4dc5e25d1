"""The 1F1B pipeline schedule (PipeDream-flush, as DeepSpeed's ``TrainSchedule``), as plain data.

Stage ``s`` of ``p`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one
backward until every micro-batch is forwarded, then drains the remaining backwards. At most ``p - s``
micro-batches' activations are alive on stage ``s`` at a time (instead of ``m`` with all-forward-then-
all-backward). Every forward receives its input from stage ``s - 1`` (not on the first stage) and sends
its output to ``s + 1`` (not on the last); every backward receives the output gradient from ``s + 1`` and
sends the input gradient to ``s - 1``.
"""

from __future__ import annotations


def train_schedule(micro_batches: int, stages: int, stage_id: int) -> list[tuple[str, int]]:
    """The ordered ``("forward" | "backward", micro_batch)`` steps of ``stage_id``."""
    if micro_batches < 1:
        raise ValueError(f"a pipeline batch needs at least one micro-batch, got {micro_batches}")
    if not 0 <= stage_id < stages:
        raise ValueError(f"stage_id {stage_id} is outside 0..{stages - 1}")
    warmup = min(stages - stage_id - 1, micro_batches)
    steps = [("forward", i) for i in range(warmup)]
    for j in range(micro_batches - warmup):
        steps += [("forward", warmup + j), ("backward", j)]
    steps += [("backward", i) for i in range(micro_batches - warmup, micro_batches)]
    return steps


def link_depth(micro_batches: int, stages: int, lower_stage: int) -> int:
    """The most messages of one direction that can be sent and not yet received on the link between
    ``lower_stage`` and ``lower_stage + 1``, in any timing of the stages: ``min(m, p - lower_stage)`` (a
    stage runs at most that many forwards ahead of its backwards; checked against every reachable state
    of the schedule in tests/runtime/test_pipe_module.py). A channel with that many slots per tensor never
    makes a send wait."""
    return max(1, min(micro_batches, stages - lower_stage))


def eval_schedule(micro_batches: int) -> list[tuple[str, int]]:
    """Forwards only, in order (every stage)."""
    return [("forward", i) for i in range(micro_batches)]


def bubble_fraction(micro_batches: int, stages: int) -> float:
    """The 1F1B idle fraction in theory, equal forward/backward times per stage: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
