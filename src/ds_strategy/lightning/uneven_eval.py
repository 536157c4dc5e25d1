"""Validation and test at stage 3 with iterable data that gives the ranks different numbers of batches.

[Note: uneven evaluation]
Lightning pads what its distributed sampler splits, but an ``IterableDataset`` sharded by rank (streaming
data) can give rank 0 three batches and rank 1 two. DDP runs such an evaluation (its forwards are local);
at stage 3 every forward gathers the partitioned weights with every rank, so rank 0's third forward would
wait for rank 1, which has gone on to the epoch's metric sync: both would wait for the process group's
timeout (30 minutes). A length-less evaluation dataloader is therefore wrapped: when a rank's batches run
out it joins one labelled closing gather on the weights' own path (``ParamGatherer.check_agreement``).
Ranks that run out together pair there; a rank still in a forward meets a different label, and both raise
at once, this one with the explanation below. (A dataloader with a length is counted and padded by
Lightning; on a GPU, where labels do not ride on the gathers, the closing gather is not a collective.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class EndOfData:
    """``dataloader`` as Lightning sees it (attributes, ``len`` where it has one), whose iterator calls
    ``at_end`` once when the batches run out (see [Note: uneven evaluation])."""

    def __init__(self, dataloader: Any, at_end: Callable[[], None], rank: int) -> None:
        self._loader = dataloader
        self._at_end = at_end
        self._rank = rank

    def __iter__(self) -> Iterator[Any]:
        count = 0
        for batch in self._loader:
            count += 1
            yield batch
        try:
            self._at_end()
        except RuntimeError as err:
            raise RuntimeError(
                f"ZeRO stage 3: the ranks' evaluation batches ran out at different points (rank {self._rank} has "
                f"no batch after {count}, another rank is still in a forward). Every forward gathers the "
                "partitioned weights on every rank, so every rank needs the same number of validation/test "
                "batches: shard the iterable dataset evenly, give it a length (Lightning then splits it "
                "evenly), or set limit_val_batches / limit_test_batches"
            ) from err

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
