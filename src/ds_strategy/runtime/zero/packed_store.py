"""Stage 3's storage of another library's 4-bit packed parameters (QLoRA's base): raw bytes, partitioned.

[Note: packed partitions]
A bitsandbytes 4-bit weight is packed codes plus the quantization state its kernels read beside them
([Note: packed parameters] in runtime/packed.py). Stage 3 partitions both like any frozen parameter, in
a ``ShardedGroup`` of their own (``Stage3.packed``) whose flat layout counts bytes: a parameter's entry is
its codes' bytes followed by its state tensors' bytes (``absmax``; the second level's under double
quantization), each piece padded to 16 bytes so that every piece starts where its dtype can be viewed.
The partition and the gathered buckets are uint8, so a gather all-gathers bytes; then the parameter's
``.data`` and each state tensor's ``.data`` become views of the gathered bucket re-viewed as their own
dtype and shape (``view(dtype)``: the bytes are never read as numbers, never cast). A free points them at
0-element placeholders, like any partitioned parameter. The state tensors keep their identity (only
``.data`` changes), so bitsandbytes' ``QuantState``, the references autograd keeps (``ctx.state``) and a
state dict's entries still reach them; the codes autograd saves for backward are a view of the bucket's
storage, which the gather before the layer's backward refills ([Note: storage swap] in sharded.py).
Fetch units, prefetch, persistence and the live limits count a packed bucket's bytes as its elements.
No ZeRO++ quantization (the bytes are codes already) and no NVMe swap: the partition rests in memory
(the host with offload_param). When the engine lets the model go (``destroy``), the parameters and their
state go back whole, as they came (``hand_back``): a later engine partitions them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import host_memory
from ..packed import restore_repack, state_tensors, stop_repack
from .collectives import Collectives
from .partition_rest import PartitionRest
from .shard_build import BUILD_CHUNK, Shards
from .sharded import LayoutEntry, ShardedGroup

PIECE_ALIGN = 16  # bytes: every piece of an entry starts where any dtype can be viewed


@dataclass(frozen=True)
class _Piece:
    """One tensor of a packed parameter's entry: the codes or a quantization-state tensor."""

    tensor: torch.Tensor  # whose ``.data`` is pointed into the gathered bucket
    start: int  # bytes from the start of the entry
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    placeholder: torch.Tensor  # 0 elements of ``dtype``: the tensor's data while the bucket is free


class PackedGroup(ShardedGroup):
    """The packed codes and quantization state of stage 3's 4-bit parameters, partitioned as bytes (see the
    note); otherwise a frozen ``ShardedGroup``: gathered and freed by the same hooks."""

    hands_back_whole = True

    def __init__(
        self,
        index: int,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        root: nn.Module,
        coll: Collectives,
        bucket_numel: int,
        breaks: Sequence[int] | set[int],
        persistent: set[int],
        param_device: torch.device,
        device: torch.device,
    ) -> None:
        self._pieces = [_pieces_of(p, device) for _, p in named_params]
        self._handed_back: set[int] = set()
        super().__init__(
            index,
            named_params,
            coll=coll,
            bucket_numel=bucket_numel,
            breaks=breaks,
            persistent=persistent,
            compute_dtype=torch.uint8,
            master_device=device,
            param_device=param_device,
            device=device,
            frozen=True,
        )
        self._repack = stop_repack(root, self.params)  # [Note: the CPU repack] in runtime/packed.py

    def _layout_entries(self, named_params: Sequence[tuple[str, nn.Parameter]]) -> list[LayoutEntry]:
        return [
            (n, (_entry_bytes(pieces),), torch.uint8) for (n, _), pieces in zip(named_params, self._pieces, strict=True)
        ]

    def _make_rest(self, *args: Any, **kwargs: Any) -> PartitionRest:
        """This rank's shards are taken, and the original codes dropped, before the partition buffer exists:
        the build's peak is then the whole base plus one bucket, not the base plus the partition (as when
        the partition is allocated first: a device allocator commits it at once)."""
        self._taken = self._take()
        return super()._make_rest(*args, **kwargs)

    @torch.no_grad()
    def _take(self) -> list[torch.Tensor]:
        """Per bucket: its bytes assembled whole, rank 0's broadcast (rank 0's values win, as for every
        parameter), this rank's shard kept; the originals dropped (persistent buckets: the whole kept)."""
        taken: list[torch.Tensor] = []
        world = self.coll.world_size
        freed = 0  # bytes of original codes and state dropped since the last heap trim
        for b, bucket in enumerate(self.layout.buckets):
            whole = torch.zeros(bucket.padded, dtype=torch.uint8, device=self.device)
            for i in bucket.params:
                at = self.layout.params[i].offset - bucket.start
                for piece in self._pieces[i]:
                    whole[at + piece.start : at + piece.start + piece.nbytes].copy_(_bytes(piece.tensor))
            self.coll.broadcast(whole)
            if b in self.persistent:
                taken.append(whole)
                continue
            taken.append(whole.view(world, -1)[self.rank].clone())
            del whole
            self._point_away(b)  # the original codes and state go
            freed += sum(piece.nbytes for piece in self._bucket_pieces(b))
            if self.device.type == "cpu" and freed >= BUILD_CHUNK:
                # glibc keeps the freed codes in its heap until a trim (as in ShardBuild): without one the build's
                # peak is the whole base plus the partition (measured: +57 MiB per rank on a 110 MiB base).
                host_memory.trim_heap()
                freed = 0
        return taken

    def _build(self, *, master_device: torch.device, pin_memory: bool) -> Shards:
        """The taken shards into the partition; bucket-sized tensors (whole for persistent buckets, whose
        tensors the group points into them, else storage-less until a gather)."""
        full: list[torch.Tensor] = []
        live: list[bool] = []
        world = self.coll.world_size
        taken, self._taken = self._taken, []
        for b, bucket in enumerate(self.layout.buckets):
            persistent = b in self.persistent
            self.rest.write(b, taken[b].view(world, -1)[self.rank] if persistent else taken[b])
            if persistent:
                full.append(taken[b])
            else:
                storage_less = torch.empty(bucket.padded, dtype=torch.uint8, device=self.device)
                host_memory.release(storage_less)
                full.append(storage_less)
            live.append(persistent)
        del taken  # the shards, copied
        if self.device.type == "cpu":
            host_memory.trim_heap()
        return Shards(aliased=False, master_flat=None, masters=[], full=full, live=live)

    def _bucket_pieces(self, bucket: int) -> list[_Piece]:
        return [piece for i in self.layout.buckets[bucket].params for piece in self._pieces[i]]

    def _point_params(self, bucket: int) -> None:
        full = self.full[bucket]
        cached = self._param_views.get(bucket)
        if cached is None or cached[0] is not full:  # views made once per bucket tensor (see ShardedGroup)
            start = self.layout.buckets[bucket].start
            views = []
            for i in self.layout.buckets[bucket].params:
                at = self.layout.params[i].offset - start
                for piece in self._pieces[i]:
                    raw = full[at + piece.start : at + piece.start + piece.nbytes]
                    views.append(raw.view(piece.dtype).view(piece.shape))
            cached = self._param_views[bucket] = (full, views)
        for piece, view in zip(self._bucket_pieces(bucket), cached[1], strict=True):
            piece.tensor.data = view

    def _point_away(self, bucket: int) -> None:
        if bucket in self._handed_back:
            return
        for piece in self._bucket_pieces(bucket):
            piece.tensor.data = piece.placeholder

    def bucket_tensors(self, bucket: int) -> list[torch.Tensor]:
        """The parameters and their quantization-state tensors."""
        return [piece.tensor for piece in self._bucket_pieces(bucket)]

    @torch.no_grad()
    def hand_back(self, bucket: int) -> None:
        """The gathered (or persistent) ``bucket``'s parameters and state keep a copy of their bytes of their
        own, off this group's buckets, for good (the engine's ``destroy``: see the note)."""
        for piece in self._bucket_pieces(bucket):
            piece.tensor.data = piece.tensor.data.clone()
        self._handed_back.add(bucket)
        if len(self._handed_back) == len(self.layout.buckets):
            restore_repack(self._repack)


def _pieces_of(p: nn.Parameter, device: torch.device) -> list[_Piece]:
    """The codes of ``p``, then its quantization-state tensors, each at a 16-byte boundary of the entry."""
    tensors = [p, *(state_tensors(p) or [])]
    pieces, start = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        placeholder = torch.empty(0, dtype=t.dtype, device=device)
        pieces.append(_Piece(t, start, nbytes, t.dtype, t.shape, placeholder))
        start += -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN
    return pieces


def _entry_bytes(pieces: Sequence[_Piece]) -> int:
    last = pieces[-1]
    return -(-(last.start + last.nbytes) // PIECE_ALIGN) * PIECE_ALIGN


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view where it is contiguous)."""
    return t.data.reshape(-1).view(torch.uint8)
