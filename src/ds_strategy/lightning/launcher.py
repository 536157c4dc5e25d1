"""The fork launcher of notebooks: Lightning's ``_MultiProcessingLauncher`` with full weights sent back.

Lightning's launcher sends rank 0's ``lightning_module.state_dict()`` to the kernel after ``fit``. Under
ZeRO stage 3 a rank only holds shards, so ours asks the strategy for the full state dict instead (a
collective under stage 3: every rank computes it, rank 0 sends it).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        strategy = self._strategy
        state_dict = strategy.lightning_module_state_dict()  # every rank: a collective under stage 3
        if strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
