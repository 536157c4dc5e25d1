"""Give freed gather buffers back to the operating system (stage 3 on CPU, glibc).

[Note: glibc keeps freed gather buffers resident]
Stage 3 allocates a full-size buffer for each bucket before its module runs and frees it right after,
several times per step. glibc's malloc raises its mmap threshold dynamically (up to 32 MiB) once such a
block is freed, so later buckets come from the heap, and freed heap memory stays in the process: peak
RSS then barely shows the parameters that stage 3 no longer keeps (measured on the ~25M-parameter GPT,
2 ranks: 42% of the theoretical saving instead of over 100%). Pinning the mmap and trim thresholds at
1 MiB (what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do) returns every large freed block at
once; the step time stays within the stage-2 budget (docs/zero3.md). A user's own MALLOC_* settings win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20


@cache
def return_freed_memory_to_os() -> bool:
    """Pin glibc's mmap/trim thresholds at 1 MiB for this process, once; False where that does not apply
    (not glibc, or the user chose the thresholds through MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_)."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): their allocators return large blocks by themselves
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
