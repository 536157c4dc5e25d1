"""Stage 3's divergence detection: the ranks compare what they gather, so a rank taking another code path
raises on every rank instead of hanging or pairing up the wrong all-gathers.

[Note: divergence detection]
If ranks run different modules (data-dependent control flow), their all-gathers would pair up wrongly:
a hang, or silently wrong weights when sizes happen to match. Every fetch therefore carries a label
(module index, fetch number: one int64 *code*) that the ranks compare. Where the buckets go through the
shared-memory path (CPU ranks on one node), the label rides on the all-gathers themselves: the path
compares it with the op, dtype and size after its first barrier, so a mismatch raises on every rank at
no extra cost, and one more labelled gather per iteration (end of backward, or of a no-grad forward:
[Note: the closing label]) catches ranks whose divergence never reached a gather. On other paths the
first iteration (which records the order and may synchronise), and every iteration on a CPU (gloo: the
host waits for its collectives anyway), all-reduce a tiny header per fetch in the same stream of
collectives, issued before the fetch's gathers. On a GPU after the first iteration no fetch issues a
collective of its own: its code is written into this iteration's *log* on the device (one small fill, no
copy), and ``check_agreement`` all-reduces the whole log once ([Note: the device log]).

A header is this rank's code in its own slot of a ``[world]`` int64 vector, built on the device (a
multiplication of a one-hot vector made once, no host-to-device copy) and summed over the ranks
asynchronously: afterwards every rank holds every rank's code. [Note: comparing on the device] says how
the headers are compared without the host waiting for them.

A gather or header that does not complete within the gather timeout (``DS_STRATEGY_GATHER_TIMEOUT``
seconds, default: the process group's, or the shared-memory path's, timeout) raises an error naming this
rank and the module it was gathering; a gather that fails while a header shows a mismatch raises the
divergence error instead. The check asks the communicator's ``CollectivePath`` (comm/paths.py) whether
gathers compare tags and what its timeout is, and sends headers through the communicator like every other
collective.

[Note: comparing on the device]
A step must not wait for the device (docs/zero3.md, "No host synchronisation in a step"), and reading a
header on the host waits for every kernel queued before it. So:

* The first iteration (until the first ``check_agreement``: the one that records the prefetch order, and
  that may synchronise) compares eagerly: a fetch that must block on its own buckets first waits for the
  outstanding headers and reads them, so a divergence there raises before a wrongly paired gather.
* Afterwards a fetch only issues its header. On a CPU device a blocking fetch still waits for the
  outstanding headers (with the gather timeout: gloo's wait is the host's anyway), without reading them;
  on a GPU nothing waits (a timed wait would block the host: the process group's own timeout applies).
* ``check_agreement`` (end of backward, end of a no-grad forward) compares the iteration's headers on the
  device - a header is consistent when its non-zero slots are equal (a rank's slot is never zero; under a
  process group that moves no data, torch's fake one, the other slots stay zero and are not compared) -
  and copies a two-number summary (any mismatch, the first one) to pinned host memory without blocking,
  with an event. A later ``check_agreement`` reads the summaries whose copy has landed (``event.query()``:
  no wait) and raises naming the ranks and modules of the first mismatch (reading that one header is the
  error path). On a CPU device the copy is immediate, so the iteration's own check reads it.

[Note: the device log]
One int64 slot per fetch of the iteration in order, kept as host numbers while the iteration runs (a fetch
launches nothing for its label; the capacity: twice the first iteration's fetches, plus 16; fetches beyond
it fold into the last slot as a running product-and-sum in int64, so a longer iteration still differs
there). ``check_agreement`` copies the slots in one copy (pinned on a GPU: the host does not wait) into this
rank's row of a zeroed ``[world, capacity]`` tensor on the device, all-reduces that (one collective per
iteration, where the headers took one per fetch: on NCCL each is a launch and a latency on the stream the
gathers share) and compares slot by slot on the device among the ranks whose row is filled (torch's fake
group moves no data: the other rows stay zero). A rank that fetched less leaves zeros where the others have
codes: a mismatch. The summary and the error path are the headers' (below); the error names the first
mismatched slot's ranks and modules.

The trade-off: on a GPU, after the first iteration, a divergence is reported one iteration or so late,
after the wrongly paired gathers ran (a hang ends at the process group's timeout, not with this error,
and a size-matched pairing computes one wrong iteration first); in exchange no fetch and no iteration end
waits for the device. Each rank raises on its own reading of the same sums: no extra collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds_strategy.accelerator import strict

from .collectives import Collectives

INDEX_BITS = 20  # a gather label: fetch number << 20 | (module index + 2)
_MASK = (1 << INDEX_BITS) - 1


def _wrap64(value: int) -> int:
    """``value`` as int64 arithmetic leaves it (two's complement wrap-around)."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


# A collective outside the model (Lightning's metric reduction, a barrier, a broadcast) met before it runs: its
# label's module slot is all ones (no module has that index), its fetch field the operation (see [Note: meeting
# before a collective outside the model]).
OUTSIDE_OPS = ("reduce", "barrier", "broadcast", "all_gather")
_OUTSIDE_SLOT = _MASK
PATHS_DIFFER = "the ranks called different collectives"  # the shared-memory path's words (csrc/comm)
_FOLD = 1_000_003  # folds fetches beyond the log's capacity into its last slot (see [Note: the device log])
SUMMARY_COPY = "stage-3 divergence check: the iteration's summary copied to pinned host memory without waiting"
ERROR_PATH = "stage-3 divergence check: reading the mismatched header to name the ranks (error path)"
FIRST_ITERATION = "stage-3 divergence check: the first iteration compares its headers eagerly"


@dataclass
class _Header:
    handle: Any  # the all-reduce's handle, None once waited for
    codes: torch.Tensor  # [world] int64 on the device: every rank's code once reduced
    mid: int
    seq: int


@dataclass
class _Summary:
    """One iteration's comparison: ``host`` = (any mismatch, index of the first) once ``ready``."""

    host: torch.Tensor
    event: Any  # a torch.cuda.Event, or None when the copy was immediate
    codes: torch.Tensor  # [n, world] on the device
    labels: list[tuple[int, int]]  # (mid, seq) per header, on the host

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


class DivergenceCheck:
    """Labels every fetch of stage 3 and compares the labels across ranks (see the module docstring).

    ``names`` / ``index``: each module's name and position by ``id(module)`` (-1: GatheredParameters);
    ``probe``: a tensor like the buckets gathered (its path decides whether labels ride on the gathers).
    """

    # Whether fetches after the first iteration write the device log instead of a header each ([Note: the
    # device log]); None: where the host does not wait for collectives (a GPU). Tests set True on a CPU.
    DEVICE_LOG: bool | None = None

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
        # Tagged: the iteration's closing label rides a tiny gather on the same path as the buckets (see
        # [Note: the closing label]); made once, like the buckets' dtype and device.
        self._closing = probe.new_zeros(coll.world_size) if self.tagged and probe is not None else None
        self._seq = 0
        self._last_mid = -1
        self._headers: list[_Header] = []  # this iteration's
        self._summaries: list[_Summary] = []  # compared on the device, not read yet
        self._checks = 0  # check_agreement calls so far: the first iteration compares eagerly
        self._onehot: torch.Tensor | None = None
        # On a GPU nothing waits for a header (a timed wait would block the host); a CPU's waits are the host's.
        self._host_waits = torch.device(device).type == "cpu"
        logs = self.DEVICE_LOG if self.DEVICE_LOG is not None else not self._host_waits
        self._logs = logs and not self.tagged and coll.world_size > 1
        self._capacity = 0  # the log's slots, sized after the first iteration
        self._codes: list[int] = []  # this iteration's slots (host numbers: one copy to the device per iteration)
        self._logged: list[tuple[int, int]] = []  # (mid, seq) per slot, on the host

    # ------------------------------------------------------------------ the interface param_gather.py calls
    def label(self, mid: int, *, blocking: bool) -> int:
        """Count a fetch of ``mid`` and label it; the label to pass to its gathers (0 where headers carry it)."""
        if self.coll.world_size == 1:
            return 0
        self._seq += 1
        self._last_mid = mid
        if self.tagged:
            return self._seq << INDEX_BITS | (self.index.get(mid, -1) + 2)
        if self._logs and not self._eager:
            self._write_log(mid, self._seq)
            return 0
        self._header(mid, self._seq)
        if blocking and (self._eager or self._host_waits):
            self._wait_headers(read=self._eager)
        return 0

    def check_agreement(self) -> None:
        """End of an iteration: compare its headers (see [Note: comparing on the device]); raise if a
        comparison whose result has reached the host shows a mismatch."""
        if self.coll.world_size == 1:
            return
        if self.tagged:
            self._close_tagged()
            self._checks += 1
            return
        eager = self._eager
        self._checks += 1
        if eager:
            fetches = len(self._headers)
            self._wait_headers(read=True)
            self._headers.clear()
            if self._logs:
                self._capacity = 2 * fetches + 16
            return
        headers, self._headers = self._headers, []
        if headers:
            for h in headers:
                self._wait(h)
            self._summaries.append(self._summarise(torch.stack([h.codes for h in headers]), headers))
        if self._logged:
            self._summaries.append(self._exchange_log())
        self._read_landed()

    def gather_failed(self, err: RuntimeError, tag: int, mid: int) -> RuntimeError:
        """The error to raise for a failed labelled gather: the ranks' modules when the path compared labels,
        else a timeout naming this rank's module."""
        if not tag:  # headers: one issued before the failed gather may show the ranks apart (error path)
            try:
                found = self._mismatch_now()
            except RuntimeError:
                found = None
            return found if found is not None else err
        seq = tag >> INDEX_BITS
        tags = self.coll.peer_tags() if "different collectives" in str(err) else []
        if tags:  # each rank's label back to (module index + 2, fetch number), as the headers carry them
            return self._diverged(mid, seq, [[t & _MASK, t >> INDEX_BITS] for t in tags])
        path_timeout = None if self.gather_path is None else self.gather_path.timeout
        return self._timed_out(mid, seq, err, path_timeout)

    def _close_tagged(self) -> None:
        """[Note: the closing label] Where labels ride on the gathers, an iteration ends with one more labelled
        gather of ``world`` elements on the buckets' own path, so a rank whose divergence never reached a
        bucket gather (one rank ran an extra forward, the other went on to its backward's reduce-scatters)
        meets a different collective there: the path compares operation, size and label at its first
        barrier and raises on every rank at once. (An int64 header would travel by another transport, gloo,
        and each rank would wait for its peer on a different one until a timeout.) Its label is the fetch
        count with the module slot 0 ("not gathering a module"), so it pairs with no fetch."""
        assert self._closing is not None
        mine = self._closing[self.coll.rank : self.coll.rank + 1]
        tag = self._seq << INDEX_BITS
        try:
            self.coll.all_gather(self._closing, mine, tag=tag)
        except RuntimeError as err:
            raise self.gather_failed(err, tag, self._last_mid) from err

    def meet(self, what: str) -> None:
        """[Note: meeting before a collective outside the model] A rank that runs a forward its peers skip (a
        sample logged on rank 0 only) waits in a parameter gather on the shared-memory path while the peers go
        on to Lightning's next collective - a gloo barrier or all-reduce - and each would wait for the other
        on a different transport until a timeout (30 minutes). So, where labels ride on the gathers, the
        strategies' own collectives first run one labelled gather of ``world`` elements on the same path
        (``what``: one of ``OUTSIDE_OPS``): the path compares it with the peer's parameter gather and every
        rank raises at once, naming what each was doing. Ranks that agree pay one tiny gather."""
        if not self.tagged or self.coll.world_size == 1:
            return
        assert self._closing is not None
        mine = self._closing[self.coll.rank : self.coll.rank + 1]
        tag = (OUTSIDE_OPS.index(what) + 1) << INDEX_BITS | _OUTSIDE_SLOT
        try:
            self.coll.all_gather(self._closing, mine, tag=tag)
        except RuntimeError as err:
            tags = self.coll.peer_tags() if PATHS_DIFFER in str(err) else []
            if not tags:
                raise
            by_rank = ", ".join(f"rank {r} {self._doing([t & _MASK, t >> INDEX_BITS])}" for r, t in enumerate(tags))
            raise RuntimeError(
                f"ZeRO-3: ranks diverged before a collective outside the model (this is rank {self.coll.rank}, "
                f"about to {what}): {by_rank}. A forward (or generate()) ran on some ranks only: under stage 3 "
                "every forward gathers the partitioned weights from every rank, so run it on every rank and use "
                "its result where you need it (e.g. log a sample on rank 0 only)."
            ) from err

    # ------------------------------------------------------------------ headers
    @property
    def _eager(self) -> bool:
        return self._checks == 0

    def _header(self, mid: int, seq: int) -> None:
        if self._onehot is None:  # once: this rank's slot (a small copy at the first fetch, not per fetch)
            onehot = torch.zeros(self.coll.world_size, dtype=torch.int64)
            onehot[self.coll.rank] = 1
            self._onehot = onehot.to(self.device)
        code = seq << INDEX_BITS | (self.index.get(mid, -1) + 2)  # never 0: index + 2 >= 1
        codes = self._onehot * code  # on the device, from a Python number: no copy
        handle = self.coll.all_reduce(codes, async_op=True)
        self._headers.append(_Header(handle, codes, mid, seq))

    def _wait(self, header: _Header) -> None:
        if header.handle is None:
            return
        handle, header.handle = header.handle, None
        try:
            handle.wait(self.timeout_s if self._host_waits else None)
        except RuntimeError as err:
            raise self._timed_out(header.mid, header.seq, err) from err

    def _wait_headers(self, *, read: bool) -> None:
        """Wait for this iteration's headers; ``read``: compare them on the host now (the first iteration)."""
        for h in self._headers:
            already = h.handle is None
            self._wait(h)
            if read and not already:
                with strict.host_read_allowed(FIRST_ITERATION):
                    codes = h.codes.tolist()
                if _mismatched(codes):
                    raise self._diverged(h.mid, h.seq, _rows(codes))

    # ------------------------------------------------------------------ comparing on the device
    def _summarise(self, codes: torch.Tensor, labels: list[Any], *, rows_filled: bool = False) -> _Summary:
        """Compare ``codes`` ([n, world]) across the ranks on the device. Headers: a zero slot was never
        filled (no data moved there) and is not compared. The log (``rows_filled``): a rank whose whole row
        is zero moved no data; a zero slot in a filled row is a fetch that rank did not make."""
        if rows_filled:
            filled = codes.ne(0).any(dim=0, keepdim=True)  # [1, world]
            big = torch.iinfo(torch.int64).max
            hi = torch.where(filled, codes, -1).amax(dim=1, keepdim=True)
            lo = torch.where(filled, codes, big).amin(dim=1, keepdim=True)
        else:
            hi = codes.amax(dim=1, keepdim=True)
            lo = torch.where(codes == 0, hi, codes).amin(dim=1, keepdim=True)
        bad = (hi != lo).squeeze(1)
        summary = torch.stack([bad.any().long(), bad.long().argmax()])
        event = None
        if summary.device.type == "cuda":
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host.copy_(summary, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = torch.empty(2, dtype=torch.int64)
            with strict.host_read_allowed(SUMMARY_COPY):  # pinned and non-blocking on a GPU
                host.copy_(summary)
        return _Summary(host, event, codes, [(h.mid, h.seq) if isinstance(h, _Header) else h for h in labels])

    # ------------------------------------------------------------------ the device log ([Note: the device log])
    def _write_log(self, mid: int, seq: int) -> None:
        code = seq << INDEX_BITS | (self.index.get(mid, -1) + 2)
        if len(self._codes) < self._capacity:
            self._codes.append(code)  # a host number: a fetch launches nothing for its label
            self._logged.append((mid, seq))
        else:  # beyond the capacity: folded into the last slot (its label stays the last one logged)
            self._codes[-1] = _wrap64(self._codes[-1] * _FOLD + code)

    def _exchange_log(self) -> _Summary:
        """All-reduce this iteration's log in this rank's row (one collective) and compare it on the device.
        The slots come from the host in one copy (pinned on a GPU: it does not wait)."""
        rows = torch.zeros(self.coll.world_size, self._capacity, dtype=torch.int64, device=self.device)
        codes = torch.tensor(self._codes + [0] * (self._capacity - len(self._codes)), dtype=torch.int64)
        if rows.is_cuda:
            codes = codes.pin_memory()
        rows[self.coll.rank].copy_(codes, non_blocking=True)
        handle = self.coll.all_reduce(rows, async_op=True)
        header = _Header(handle, rows, self._last_mid, self._seq)
        self._wait(header)
        labels = self._logged + [self._logged[-1]] * (self._capacity - len(self._logged))
        self._codes, self._logged = [], []
        return self._summarise(rows.t(), labels, rows_filled=True)

    def _read_landed(self) -> None:
        """Read the summaries whose copy has landed, oldest first; raise at the first mismatch."""
        while self._summaries and self._summaries[0].ready():
            s = self._summaries.pop(0)
            flag, first = s.host.tolist()  # host memory
            if flag:
                raise self._named(s, first)

    def _named(self, s: _Summary, first: int) -> RuntimeError:
        with strict.host_read_allowed(ERROR_PATH):
            codes = s.codes[first].tolist()
        mid, seq = s.labels[first]
        return self._diverged(mid, seq, _rows(codes))

    def _mismatch_now(self) -> RuntimeError | None:
        """After a failed gather: the first mismatch among the headers issued so far, read now (waiting)."""
        with strict.host_read_allowed(ERROR_PATH):
            for s in self._summaries:
                flag, first = s.host.tolist() if s.ready() else (0, 0)
                if flag:
                    return self._named(s, first)
            for h in self._headers:
                self._wait(h)
                codes = h.codes.tolist()
                if _mismatched(codes):
                    return self._diverged(h.mid, h.seq, _rows(codes))
        return None

    def verify_headers(self) -> None:
        """Wait for the outstanding headers and compare them now, on the host (a synchronisation: for tests
        and for callers outside a step); raise naming the ranks/modules if they do not match."""
        with strict.host_read_allowed(ERROR_PATH):
            found = self._mismatch_now()
            if self._logged:  # a collective: every rank calls this at the same point
                self._summaries.append(self._exchange_log())
            while self._summaries:
                s = self._summaries.pop(0)
                if s.event is not None:
                    s.event.synchronize()
                flag, first = s.host.tolist()
                if flag:
                    raise self._named(s, first)
        self._headers.clear()
        if found is not None:
            raise found

    # ------------------------------------------------------------------ messages
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
        """``rows``: each rank's (module index + 2, fetch number); 0 as index + 2 is the closing label (the
        end of an iteration), and a row of zeros an unlabelled collective (a gradient reduction)."""
        by_rank = ", ".join(f"rank {r} {self._doing(row)}" for r, row in enumerate(rows))
        own = rows[self.coll.rank] if self.coll.rank < len(rows) else [1, seq]
        name = self.names.get(mid, "?")
        where = f"ending its iteration after gathering {name!r}" if own[0] == 0 else f"gathering {name!r}"
        return RuntimeError(
            f"ZeRO-3: ranks diverged at parameter gather #{seq} (this is rank {self.coll.rank}, {where}): "
            f"{by_rank}. The ranks took different code paths; under ZeRO stage 3 every rank must run the same "
            "modules in the same order (make the control flow agree across ranks; a Hugging Face generate() "
            "whose ranks stop at different lengths needs synced_gpus=True, as under DeepSpeed ZeRO-3)."
        )

    def _doing(self, row: list[int]) -> str:
        slot, seq = row
        if slot == _OUTSIDE_SLOT and 0 < seq <= len(OUTSIDE_OPS):
            what = OUTSIDE_OPS[seq - 1]
            return f"is about to {what} outside the model (Lightning: self.log(sync_dist=True), a barrier, a broadcast)"
        if slot == 0 and seq == 0:
            return "is in another collective (not a parameter gather: a gradient reduction, or the user's own)"
        if slot == 0:
            return f"ends its iteration after gather #{seq}"
        return f"gathers {self._name_of_index(slot - 2)!r} (gather #{seq})"

    def _name_of_index(self, index: int) -> str:
        if index == -1:
            return "GatheredParameters"
        for mid, i in self.index.items():
            if i == index:
                return self.names[mid]
        return f"<module #{index}>"


def diverged_in_backward(err: BaseException, rank: int) -> BaseException:
    """The error a failed backward raises: where a gradient reduction met a different collective on a peer
    (the shared-memory path compares them), say that the ranks diverged, as a parameter gather would."""
    text = str(err)
    if not isinstance(err, RuntimeError) or PATHS_DIFFER not in text or text.startswith("ZeRO"):
        return err
    return RuntimeError(
        f"ZeRO: ranks diverged in backward (this is rank {rank}, reducing gradients; another rank was in a "
        "different collective). The ranks took different code paths; every rank must run the same forward "
        f"and backward in the same order (make the control flow agree across ranks). The path said: {text}"
    )


def _mismatched(codes: list[int]) -> bool:
    """Whether the ranks' codes differ (slots left at 0 - no data moved there - are not compared)."""
    filled = {c for c in codes if c}
    return len(filled) > 1


def _rows(codes: list[int]) -> list[list[int]]:
    """Each rank's code as (module index + 2, fetch number)."""
    return [[c & _MASK, c >> INDEX_BITS] for c in codes]
