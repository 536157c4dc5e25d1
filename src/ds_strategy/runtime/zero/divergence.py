"""Stage 3's divergence detection: the ranks compare what they gather, so a rank taking another code path
raises on every rank instead of hanging or pairing up the wrong all-gathers.

[Note: divergence detection]
If ranks run different modules (data-dependent control flow), their all-gathers would pair up wrongly:
a hang, or silently wrong weights when sizes happen to match. Every fetch therefore carries a label
(module index, fetch number) that the ranks compare. Where the buckets go through the shared-memory
path (CPU ranks on one node), the label rides on the all-gathers themselves: the path compares it with
the op, dtype and size after its first barrier, so a mismatch raises on every rank at no extra cost, and
one label all-reduce per iteration (end of backward, or of a no-grad forward) catches ranks whose
divergence never reached a gather. On other paths every fetch all-reduces a tiny header in the same
stream of collectives; a fetch that must block on its own buckets first checks every outstanding header,
a fetch served by prefetched buckets leaves its header in flight until the next blocking fetch or the end
of backward (so prefetch overlap is kept). Either way a mismatch raises a RuntimeError on every rank
naming each rank's module, and a gather or header that does not complete within the gather timeout
(``DS_STRATEGY_GATHER_TIMEOUT`` seconds, default: the process group's, or the shared-memory path's,
timeout) raises one naming this rank and the module it was gathering.

The check asks the communicator's ``CollectivePath`` (comm/paths.py) whether gathers compare tags and
what its timeout is, and sends headers through the communicator like every other collective.
"""

from __future__ import annotations

from typing import Any

import torch

from .collectives import Collectives

INDEX_BITS = 20  # a gather label: fetch number << 20 | (module index + 2)


class DivergenceCheck:
    """Labels every fetch of stage 3 and compares the labels across ranks (see the module docstring).

    ``names`` / ``index``: each module's name and position by ``id(module)`` (-1: GatheredParameters);
    ``probe``: a tensor like the buckets gathered (its path decides whether labels ride on the gathers).
    """

    def __init__(
        self,
        coll: Collectives,
        device: torch.device,
        probe: torch.Tensor | None,
        names: dict[int, str],
        index: dict[int, int],
        timeout_s: float | None,
    ) -> None:
        self.coll = coll
        self.device = device  # the headers travel where the gathered buckets do (NCCL takes nothing else)
        self.names = names
        self.index = index
        self.timeout_s = timeout_s
        self.gather_path = None if probe is None else coll.route(None, probe)
        # Labels ride on the all-gathers where the path compares them.
        self.tagged = coll.world_size > 1 and self.gather_path is not None and self.gather_path.compares_tags
        if self.tagged and timeout_s is not None:  # the gathers' own waits are the path's
            self.gather_path.timeout = timeout_s  # type: ignore[union-attr]
        self._seq = 0
        self._last_mid = -1
        self._headers: list[tuple[Any, torch.Tensor, int, int]] = []

    def label(self, mid: int, *, blocking: bool) -> int:
        """Count a fetch of ``mid`` and label it; the label to pass to its gathers (0 where headers carry it)."""
        if self.coll.world_size == 1:
            return 0
        self._seq += 1
        self._last_mid = mid
        if self.tagged:
            return self._seq << INDEX_BITS | (self.index.get(mid, -1) + 2)
        self._header(mid, self._seq, blocking=blocking)
        return 0

    def check_agreement(self) -> None:
        """End of an iteration: wait for the headers in flight, or (labels on gathers) compare the last label."""
        if self.tagged and self.coll.world_size > 1:
            self._header(self._last_mid, self._seq, blocking=True)
        else:
            self.verify_headers()

    def gather_failed(self, err: RuntimeError, tag: int, mid: int) -> RuntimeError:
        """The error to raise for a failed labelled gather: the ranks' modules when the path compared labels,
        else a timeout naming this rank's module."""
        if not tag:
            return err
        seq = tag >> INDEX_BITS
        tags = self.coll.peer_tags() if "different collectives" in str(err) else []
        if tags:  # each rank's label back to (module index + 2, fetch number), as the headers carry them
            return self._diverged(mid, seq, [[t & ((1 << INDEX_BITS) - 1), t >> INDEX_BITS] for t in tags])
        path_timeout = None if self.gather_path is None else self.gather_path.timeout
        return self._timed_out(mid, seq, err, path_timeout)

    def _header(self, mid: int, seq: int, *, blocking: bool) -> None:
        # Built on the host and copied once (one small transfer, no per-element writes to device memory).
        row = torch.zeros(self.coll.world_size, 2, dtype=torch.int64)
        row[self.coll.rank, 0] = self.index.get(mid, -1) + 2  # 1: GatheredParameters, 0: nothing
        row[self.coll.rank, 1] = seq
        header = row.to(self.device)
        handle = self.coll.all_reduce(header, async_op=True)
        self._headers.append((handle, header, mid, seq))
        if blocking:
            self.verify_headers()

    def verify_headers(self) -> None:
        """Wait for the outstanding headers; raise naming the ranks/modules if they do not match."""
        headers, self._headers = self._headers, []
        for handle, header, mid, seq in headers:
            try:
                handle.wait(self.timeout_s)
            except RuntimeError as err:
                raise self._timed_out(mid, seq, err) from err
            rows = header.tolist()
            if any(row != rows[0] for row in rows):
                raise self._diverged(mid, seq, rows)

    def _timed_out(self, mid: int, seq: int, err: Exception, path_timeout: float | None = None) -> RuntimeError:
        seconds = self.timeout_s if self.timeout_s is not None else path_timeout
        limit = f"within {seconds:g}s" if seconds is not None else "(process group timeout)"
        return RuntimeError(
            f"ZeRO-3: rank {self.coll.rank} timed out in parameter gather #{seq} for module "
            f"{self.names.get(mid, '?')!r}: another rank did not gather it {limit} ({err}). The ranks took "
            "different code paths (a module skipped or called a different number of times on some rank), or "
            "another rank failed. Under ZeRO stage 3 every rank must run the same modules in the same order."
        )

    def _diverged(self, mid: int, seq: int, rows: list[list[int]]) -> RuntimeError:
        """``rows``: each rank's (module index + 2, fetch number); 0 as index + 2 means it was not gathering."""
        by_rank = ", ".join(
            f"rank {r} gathers {self._name_of_index(row[0] - 2)!r} (gather #{row[1]})" for r, row in enumerate(rows)
        )
        return RuntimeError(
            f"ZeRO-3: ranks diverged at parameter gather #{seq} (this is rank {self.coll.rank}, gathering "
            f"{self.names.get(mid, '?')!r}): {by_rank}. The ranks took different code paths; under ZeRO stage 3 "
            "every rank must run the same modules in the same order (make the control flow agree across ranks)."
        )

    def _name_of_index(self, index: int) -> str:
        if index == -1:
            return "GatheredParameters"
        for mid, i in self.index.items():
            if i == index:
                return self.names[mid]
        return "<nothing: this rank was not gathering>"
