"""``trainer.predict`` at stage 3 when the ranks hold different numbers of batches.

[Note: uneven predict]
For ``predict`` Lightning splits the data without padding (``UnrepeatedDistributedSampler``: no sample is
predicted twice), so with 9 rows, batch 4 and 2 ranks rank 0 runs 2 batches and rank 1 runs 1. At stage 3
every forward gathers its parameters with the other ranks: rank 0's second batch would wait forever for a
rank that has finished. So the ranks agree on their batch counts when the predict dataloaders are set up
(``count``: one small all-gather per dataloader, on every rank, before any forward), and a rank with fewer
batches runs its last batch's ``predict_step`` again, output discarded, once per batch it lacks
(``after_step``), right after its own last batch: its gathers pair with the other ranks' remaining forwards,
as Hugging Face's ``synced_gpus`` keeps a finished rank in the forwards. The predictions returned and
written (``BasePredictionWriter``) are each rank's own, as under DDP; a ``predict_step`` with side effects
of its own runs them once more per replay. A rank with no batch at all has no batch to replay: that is an
error on every rank, before any forward, naming the counts. A dataloader without a length cannot be
counted: nothing is replayed (the ranks must then hold equal numbers of batches).
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage


class PredictPadding:
    """The predict batches of every rank, and the replays this rank owes (see [Note: uneven predict])."""

    def __init__(self) -> None:
        self._counts: list[list[int]] = []  # per predict dataloader: every rank's batches (-1: no length)
        self._left = -1  # this rank's batches still to run; -1: nothing to replay
        self._owed = 0

    def count(
        self,
        gather: Callable[[torch.Tensor], torch.Tensor],
        dataloader: Any,
        limit: int | float,
        device: torch.device,
    ) -> None:
        """Exchange this rank's number of batches of one predict dataloader (a collective: every rank; the
        count travels on the compute ``device``, where NCCL takes it)."""
        if isinstance(dataloader, Sized):
            mine = int(_parse_num_batches(RunningStage.PREDICTING, len(dataloader), limit))
        else:
            mine = -1
        everyone = gather(torch.tensor([mine], dtype=torch.int64, device=device)).reshape(-1).tolist()
        self._counts.append([int(n) for n in everyone])

    def plan(self, rank: int) -> None:
        """After the dataloaders are counted: how many forwards this rank replays. Raises on every rank when
        a rank has no batch while another has some."""
        counts, self._counts = self._counts, []
        if not counts or any(n < 0 for per in counts for n in per):
            self._left, self._owed = -1, 0
            return
        totals = [sum(per[r] for per in counts) for r in range(len(counts[0]))]
        if min(totals) == 0 < max(totals):
            empty = [r for r, n in enumerate(totals) if n == 0]
            raise RuntimeError(
                f"trainer.predict under ZeRO stage 3: rank(s) {empty} have no predict batch while others have up "
                f"to {max(totals)} (batches per rank: {totals}). Every forward gathers the partitioned weights "
                "on every rank, so each rank needs at least one batch: give the predict dataloader at least "
                "world_size x batch_size samples"
            )
        self._left = totals[rank]
        self._owed = max(totals) - totals[rank]

    def after_step(self, replay: Callable[[], Any]) -> None:
        """After each of this rank's predict steps: past its last one, the forwards it owes."""
        if self._left < 0:
            return
        self._left -= 1
        if self._left == 0:
            owed, self._owed = self._owed, 0
            for _ in range(owed):
                replay()
