"""The fork launcher of notebooks: Lightning's ``_MultiProcessingLauncher`` with two additions.

1. Full weights back to the kernel. Lightning's launcher sends rank 0's ``lightning_module.state_dict()``
   after ``fit``; under ZeRO stage 3 a rank only holds shards, so ours asks the strategy for the full state
   dict (a collective under stage 3: every rank computes it, rank 0 sends it).

2. [Note: forking after OpenMP started]
   torch's CPU kernels run on a GNU OpenMP thread pool, which is not fork-safe: once any parallel torch op
   has run in the kernel (a matmul, initialising a 512x512 Linear), a forked child hangs in its first
   multi-threaded region (reproduced here with torch 2.13). A child that runs single-threaded is fine.
   Before forking the workers, the launcher forks a probe that runs one parallel op with the workers'
   thread count; if the probe hangs, the workers run with one thread (and a warning says why and how to
   avoid it); if even a single-threaded probe fails, it raises instead of hanging.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ._compat import _MultiProcessingLauncher, _suggested_max_num_threads, _WorkerOutput

if TYPE_CHECKING:
    import lightning.pytorch as pl

PROBE_TIMEOUT_S = 5.0


def forked_child_can_compute(threads: int, timeout: float | None = None) -> bool:
    """Whether a child forked now runs a parallel torch op on ``threads`` threads (see the Note above)."""
    timeout = PROBE_TIMEOUT_S if timeout is None else timeout
    pid = os.fork()
    if pid == 0:  # the probe: compute, then leave without running any of the parent's exit handlers
        code = 1
        try:
            torch.set_num_threads(threads)
            torch.ones(1 << 20).mul_(2.0)  # far above torch's grain size: a real parallel region
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def worker_threads(num_processes: int) -> int:
    """The intra-op thread count Lightning gives each forked worker."""
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()  # Lightning leaves the inherited setting alone
    return _suggested_max_num_threads(num_processes)


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    def __init__(
        self, strategy: pl.strategies.ParallelStrategy, start_method: Literal["spawn", "fork", "forkserver"] = "spawn"
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        self._single_thread = False

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if self._start_method == "fork":
            processes = len(self._strategy.parallel_devices or [None])
            self._single_thread = _needs_single_thread(worker_threads(processes))
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        if self._single_thread:  # before Lightning's own thread setting, which then leaves it alone
            torch.set_num_threads(1)
            os.environ["OMP_NUM_THREADS"] = "1"
        super()._wrapping_function(*args, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        strategy = self._strategy
        state_dict = strategy.lightning_module_state_dict()  # stage 3: assembled on rank 0 at teardown
        if strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)


def _needs_single_thread(threads: int) -> bool:
    """True when forked workers must run single-threaded; raises when they could not run at all."""
    if threads <= 1 or forked_child_can_compute(threads):
        return False
    if not forked_child_can_compute(1):
        raise RuntimeError(
            "a process forked from this session cannot run torch operations (a test child hung), so ZeRO "
            "workers cannot be forked from it. Restart the kernel and call fit() before running large torch "
            "computations in it, or run the code as a script"
        )
    rank_zero_warn(
        f"torch's OpenMP thread pool was already started in this session (a large torch operation ran before "
        f"fit), and forked workers would hang using it; they run with 1 thread instead of {threads}. To keep "
        "all threads: restart the kernel and call fit() before running torch computations in it (creating "
        "the model is fine; matrix products and large elementwise operations are not), or run it as a script"
    )
    return True
