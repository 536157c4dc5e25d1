"""Does a call release the GIL? A pure-Python thread counts while the call runs.

With the GIL released the counter keeps (a good part of) its free-running rate during the call; with it
held the counter stops for the whole call. Used by every kernel family's test. The call runs with one
intra-op thread: a kernel's OpenMP team on every core would starve the counter of CPU, not of the GIL (on a
2-core machine the counter then kept ~27% of its rate, a flaky margin against the 30% asked).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch


def spinner_ticks_during(call: Callable[[], object]) -> tuple[int, float, float]:
    """Run ``call`` while a Python thread spins; return (ticks during the call, free-running ticks/s, seconds)."""
    ticks = 0
    running = True

    def spin() -> None:
        nonlocal ticks
        while running:
            ticks += 1

    thread = threading.Thread(target=spin)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    thread.start()
    try:
        before, start = ticks, time.perf_counter()
        time.sleep(0.1)  # sleep releases the GIL: the spinner's free-running rate
        rate = (ticks - before) / (time.perf_counter() - start)
        before, start = ticks, time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        during = ticks - before
    finally:
        running = False
        thread.join()
        torch.set_num_threads(threads)
    return during, rate, elapsed


def assert_releases_the_gil(call: Callable[[], object], *, fraction: float = 0.3) -> None:
    during, rate, elapsed = spinner_ticks_during(call)
    assert during > fraction * rate * elapsed, (
        f"spinner ran {during} ticks in a {elapsed:.3f}s call (rate {rate:.0f}/s)"
    )
