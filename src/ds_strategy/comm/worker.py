"""One background thread that runs a communicator's shared-memory collectives in submission order.

[Note: asynchronous fast path]
The shared-memory kernels are synchronous: a call returns when every rank has passed through it, so the
caller waits for the slowest rank at each one. Run inline, an ``async_op=True`` collective (a ZeRO-3
prefetch, a reduce-scatter launched while backward continues) therefore overlaps nothing and exposes
every bit of skew between the ranks. Here such calls are queued to one daemon thread per communicator;
the kernels release the GIL, so the caller computes while the thread waits for the peers and copies. One
thread and a FIFO keep the per-rank order of collectives identical on every rank. A synchronous call
made while jobs are queued goes through the queue too (and waits), else it runs inline. The thread starts
with the first asynchronous call (a stage-2 run without overlap_comm never has one) and is stopped by an
atexit handler before interpreter finalisation: a thread still alive then is torn down by the runtime,
which can abort the process after a successful run. It is also a daemon, so that a rank stuck waiting
for a dead peer (bounded by the kernels' timeout anyway) never holds up exit.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
from collections.abc import Callable

import torch


class Job:
    """A queued collective: ``wait()`` blocks until it ran and re-raises its error (like ``dist.Work``)."""

    __slots__ = ("_done", "_error", "_fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as err:  # handed to the waiter, never lost in the thread
            self._error = err
        finally:
            self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"a queued shared-memory collective did not finish within {timeout}")
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._done.is_set()


class CollectiveWorker:
    """FIFO executor of fast-path collectives on one daemon thread (see [Note: asynchronous fast path])."""

    def __init__(self, name: str = "ds_strategy-shm") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0  # submitted, not finished (only the owning thread submits)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        threads = torch.get_num_threads()  # the kernels' OpenMP team size follows the caller's setting
        self._thread = threading.Thread(target=self._loop, args=(threads,), name=self._name, daemon=True)
        self._thread.start()
        atexit.register(self.close, wait=False)

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while (job := self._queue.get()) is not None:
            job.run()
            with self._lock:
                self._pending -= 1

    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def submit(self, fn: Callable[[], None]) -> Job:
        if self._thread is None:
            self._start()
        return self._put(Job(fn))

    def _put(self, job: Job) -> Job:
        with self._lock:
            self._pending += 1
        self._queue.put(job)
        return job

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now, after whatever is queued (inline when nothing is)."""
        if self.idle():
            fn()
        else:
            self.submit(fn).wait()

    def close(self, wait: bool = True) -> None:
        """Stop the thread (idempotent), after the queued jobs have run unless ``wait`` is False (at exit)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        atexit.unregister(self.close)
        if wait:
            self._put(Job(lambda: None)).wait()
        self._queue.put(None)
        thread.join(timeout=5 if wait else 1)
