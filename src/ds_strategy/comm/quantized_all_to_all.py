"""Quantized all-to-all reduction (ZeRO++'s qgZ): a reduce-scatter whose chunks travel as block-wise int4 /
int8 bytes through all-to-alls, and are summed in fp32 where they land.

[Note: hierarchical quantized reduce-scatter]
A reduce-scatter of ``input`` (W chunks of n elements; rank r keeps the sum of chunk r) over W = N x h
ranks, ``h`` per node (``intra``: this rank's node, ``inter``: the ranks with this rank's local index on
every node; rank r = node * h + local):

1. intra-node all-to-all: to local peer l go the chunks ``node' * h + l`` of every node', quantized to
   ``intra_bits``; each rank sums what it receives in fp32 (one ``dequantize_sum`` per node') and holds its
   node's partial sums of the N chunks its local index serves;
2. inter-node all-to-all: partial sum ``node'`` goes to node ``node'``, quantized to ``inter_bits``; the
   received N partials summed in fp32 are the group-wide sum of chunk r.

So each rank sends (W - 1)/W of the bucket at ``intra_bits`` inside its node and (N - 1)/N of a 1/h
slice at ``inter_bits`` across nodes, instead of a reduce-scatter's (W - 1)/W at 16 or 32 bits. With one
node (N = 1) only step 1 runs; with one rank per node (h = 1) only step 2. A quantized chunk travels as
one byte row (its int bytes, then its fp32 scales), so each step is one ``all_to_all_single``.

The all-to-all itself is the communicator's ``all_to_all_single`` (the shared-memory kernel on one host,
else the process group), logged in its comms logger as ``all_to_all`` with the bytes this rank sends.

With ``async_op`` the chunks are quantized at once (so ``input`` may be reused) and the first all-to-all
is issued; the call returns a handle. When only one step runs (one node, the common case, or one rank per
node), its ``wait`` sums what arrived into ``output``. With both steps the handle is a ``TwoStepHandle``:
its ``advance`` waits for step 1, sums it and issues step 2 (also asynchronously), and its ``wait``
advances if that has not happened yet, waits for step 2 and sums into ``output``. ``is_completed`` stays
False until ``advance`` ran: polling never issues step 2.

[Note: when step 2 is issued]
Step 2 is a collective, so every rank must issue it at the same point of its sequence of collectives of
every group (NCCL needs one order across communicators; on any backend, a rank blocked in one group's
collective while its peer waits for it in another deadlocks: 4 ranks in 2 nodes did, when step 2 was
issued wherever ``is_completed()`` first said step 1 had landed, a rank-dependent moment). So the caller
calls ``advance`` at points every rank reaches in the same order: ZeRO-3's reducer advances the buckets in
flight when it launches the next bucket, in the recorded bucket order (runtime/zero/reducer.py), and
``wait`` advances whatever is left. Step 2 of a bucket then overlaps the rest of backward, like step 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_strategy.comm.collectives import CommHandle, Communicator
from ds_strategy.ops.quant import Quantized, dequantize_sum, num_blocks, packed_numel, quantize


def all_to_all_bytes(coll: Communicator, send: torch.Tensor) -> torch.Tensor:
    """Row j of ``send`` (W x bytes, uint8) goes to group rank j; row j of the result came from rank j.

    Through the communicator's ``all_to_all_single``, so on one host the shared-memory kernel moves the
    rows: they travel as float32 words (padded to whole words), which an all-to-all only copies, so every
    bit pattern arrives intact; the communicator's comms logger records it as ``all_to_all``."""
    _, received = _start_all_to_all_bytes(coll, send, async_op=False)
    return received()


def _start_all_to_all_bytes(
    coll: Communicator, send: torch.Tensor, *, async_op: bool
) -> tuple[CommHandle | None, Callable[[], torch.Tensor]]:
    """``all_to_all_bytes`` issued: (its handle, None when nothing travels; the result, valid after it)."""
    if coll.world_size == 1:
        copy = send.clone()
        return None, lambda: copy
    nbytes = send.shape[1]
    pad = (-nbytes) % 4
    words = (torch.nn.functional.pad(send, (0, pad)) if pad else send.contiguous()).view(torch.float32)
    recv = torch.empty_like(words)
    handle = coll.all_to_all_single(recv, words, async_op=async_op)

    def received(words: torch.Tensor = words) -> torch.Tensor:  # words: alive until the exchange is read
        return recv.view(torch.uint8)[:, :nbytes]

    return handle, received


def _pack(qt: Quantized, dests: int) -> torch.Tensor:
    """``qt`` of dests x k rows -> one byte row per destination: its k rows' int bytes, then their scales."""
    q = qt.q.reshape(dests, -1).view(torch.uint8)
    s = qt.scales.reshape(dests, -1).view(torch.uint8)
    return torch.cat([q, s], dim=1)


def _unpack(rows: torch.Tensor, k: int, n: int, block_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``_pack`` for ``rows`` (sources x bytes): q (sources, k, packed) and scales (sources, k, nb)."""
    sources = rows.shape[0]
    qbytes = k * packed_numel(n, bits)
    q = rows[:, :qbytes].reshape(sources, k, -1).view(torch.int8)
    s = rows[:, qbytes:].contiguous().view(torch.float32).reshape(sources, k, -1)
    return q, s


def _exchange_and_sum(
    coll: Communicator, chunks: torch.Tensor, block_size: int, bits: int, *, async_op: bool = False
) -> tuple[CommHandle | None, Callable[[], torch.Tensor]]:
    """``chunks`` (dests x k x n): quantize, send row d to group rank d; returns (the exchange's handle, a
    function giving the fp32 (k x n) sum of the k-chunk rows every rank sent here, once it completed)."""
    dests, k, n = chunks.shape
    qt = quantize(chunks.reshape(dests * k, n), block_size, bits)
    handle, received = _start_all_to_all_bytes(coll, _pack(qt, dests), async_op=async_op)

    def summed() -> torch.Tensor:
        q, s = _unpack(received(), k, n, block_size, bits)
        out = torch.empty(k, n, dtype=torch.float32, device=chunks.device)
        for j in range(k):  # chunk j of every source: one fp32 sum over the sources
            dequantize_sum(Quantized(q[:, j].contiguous(), s[:, j].contiguous(), block_size, bits), out[j])
        return out

    return handle, summed


def quantized_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    intra: Communicator,
    inter: Communicator,
    block_size: int,
    intra_bits: int = 4,
    inter_bits: int = 8,
    async_op: bool = False,
) -> CommHandle | TwoStepHandle | None:
    """``output`` = this rank's chunk of the sum of every rank's ``input`` (see the module note); ``intra``
    and ``inter`` are this rank's node group and cross-node group (either may have one rank). With
    ``async_op``: a handle whose ``wait`` completes ``output`` (a ``TwoStepHandle`` when both steps run;
    None when nothing is left to wait for); without: None, ``output`` complete."""
    h, nodes = intra.world_size, inter.world_size
    n = output.numel()
    if input.numel() != h * nodes * n:
        raise ValueError(
            f"quantized_reduce_scatter: input has {input.numel()} elements; {h} x {nodes} ranks x {n} expected"
        )
    if n == 0:
        return None
    chunks = input.reshape(nodes, h, n)
    if h > 1:  # to local peer l: chunks node' * h + l of every node'
        handle, partial = _exchange_and_sum(intra, chunks.transpose(0, 1), block_size, intra_bits, async_op=async_op)
        if nodes > 1:  # then to node n': its partial sum of chunk n' * h + local
            step2 = TwoStepHandle(
                handle,
                lambda: _exchange_and_sum(inter, partial().unsqueeze(1), block_size, inter_bits, async_op=async_op),
                output,
            )
            if not async_op:
                step2.wait()
                return None
            return step2
    elif nodes > 1:  # one rank per node: step 2 is the first
        partials = chunks[:, 0].float().unsqueeze(1)
        handle, partial = _exchange_and_sum(inter, partials, block_size, inter_bits, async_op=async_op)
    else:  # a group of one: nothing travels, nothing is quantized
        output.copy_(chunks[0, 0])
        return None

    def land() -> None:
        output.copy_(partial()[0])

    if async_op and handle is not None:
        return CommHandle(children=[handle], finish=land)  # wait: the exchange, then the sum lands
    if handle is not None:
        handle.wait()
    land()
    return None


class TwoStepHandle:
    """Both steps of a hierarchical quantized reduce-scatter: ``advance`` waits for step 1 and issues step
    2 (``second``); ``wait`` advances if needed, waits for step 2 and writes the sum into ``output``. Where
    to call ``advance``: [Note: when step 2 is issued]."""

    __slots__ = ("_first", "_output", "_second", "_summed", "_work")

    def __init__(
        self,
        first: CommHandle | None,
        second: Callable[[], tuple[CommHandle | None, Callable[[], torch.Tensor]]],
        output: torch.Tensor,
    ) -> None:
        self._first, self._output = first, output
        self._second: Callable[[], tuple[CommHandle | None, Callable[[], torch.Tensor]]] | None = second
        self._work: CommHandle | None = None
        self._summed: Callable[[], torch.Tensor] | None = None

    @property
    def advanced(self) -> bool:
        """Step 2 is issued."""
        return self._second is None

    def advance(self) -> None:
        """Wait for step 1, sum it and issue step 2 (idempotent)."""
        if self._second is None:
            return
        second, self._second = self._second, None
        first, self._first = self._first, None
        if first is not None:
            first.wait()
        self._work, self._summed = second()  # step 1's buffers go with ``second``

    def is_completed(self) -> bool:
        """Step 2 was issued and has finished (never issues it: see the class note)."""
        return self._second is None and (self._work is None or self._work.is_completed())

    def wait(self) -> None:
        self.advance()
        if self._summed is None:
            return  # waited before
        if self._work is not None:
            self._work.wait()
        summed, self._summed = self._summed, None
        self._output.copy_(summed()[0])
        self._output = None  # type: ignore[assignment]


def wire_bytes(n: int, block_size: int, bits: int) -> int:
    """Bytes one chunk of ``n`` elements takes on the wire (int bytes + fp32 scales)."""
    return packed_numel(n, bits) + 4 * num_blocks(n, block_size)
