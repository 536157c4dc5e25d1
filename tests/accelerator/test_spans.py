"""accelerator/spans.py: a span is torch's record_function while a profiler records (its label in the
trace), and a shared no-op otherwise, whose label, when given as a callable, is never built."""

from __future__ import annotations

import torch

from ds_strategy.accelerator.spans import profiling, span


def test_span_without_a_profiler_builds_nothing() -> None:
    built: list[str] = []

    def label() -> str:
        built.append("x")
        return "ds::never"

    assert not profiling()
    first, second = span(label), span("ds::plain")
    assert first is second  # the shared no-op: nothing allocated per call
    with first:
        pass
    assert built == []


def test_span_under_a_profiler_is_in_the_trace() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert profiling()
        with span(lambda: "ds::built_label"):
            torch.ones(2).add_(1)
        with span("ds::plain_label"):
            torch.ones(2).add_(1)
    names = {e.name for e in prof.events()}
    assert {"ds::built_label", "ds::plain_label"} <= names
    assert not profiling()
