"""Named spans in a profiler trace (``ds::all_gather``, ``ds::gather[model.layers.3]``) that cost nothing when
no profiler records: ``torch.profiler.record_function`` builds a RecordFunction (~6 us) whether or not a
profiler is on, and stage 3 opens several per fetch, in the host's critical path."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.profiler import record_function

_NOTHING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


# Whether a torch profiler (torch.profiler.profile, torch.autograd.profiler.profile) records now: torch's own
# C function, called directly (no Python frame between it and every span).
profiling: Callable[[], bool] = torch._C._autograd._profiler_enabled


def span(name: str | Callable[[], str]) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records, else a shared no-op; ``name`` may be a callable,
    so that a label built from strings is built only then."""
    if not profiling():
        return _NOTHING
    return record_function(name() if callable(name) else name)
