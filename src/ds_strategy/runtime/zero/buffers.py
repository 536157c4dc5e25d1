"""One param group's flat buffers: the compute-dtype parameters and the fp32 master weights.

[Note: parameters are views]
Every trainable parameter's ``.data`` becomes a view into its group's flat buffer in the compute dtype
(``param.data = flat[offset:offset + numel].view(shape)``): the module keeps its ``nn.Parameter``
objects (so references held by the user or a client optimizer stay valid) while an all-gather of a
bucket writes updated weights straight into the model.

[Note: master weights]
The optimizer steps fp32 *master* tensors, one ``nn.Parameter`` per bucket: this rank's shard of the
bucket (stages 1-2) or the whole bucket (stage 0). When the compute dtype is fp32 and the masters stay
on the parameters' device, a master *is* the shard of the flat parameter buffer (a view, no copy): the
optimizer updates the model in place. Otherwise (bf16/fp16, or optimizer offload to another device) the
masters are a separate contiguous fp32 buffer on the master device, copied back (with the cast) after
each step. Masters are initialised from the original fp32 parameters before any cast to 16 bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..layout import FlatLayout
from ..swap import OptimizerSwapper
from .collectives import Collectives


class GroupStorage:
    """What stages and checkpoints use of one param group's storage, whatever keeps it: the flat buffers
    of stages 0-2 (``GroupState``) or stage 3's shards (``ShardedGroup``). Each subclass builds all of
    it in its own ``__init__``; the methods here only read the layout."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    partitioned: bool  # masters hold this rank's shard of each bucket (else the whole bucket: stage 0)
    rank: int
    layout: FlatLayout
    device: torch.device  # the compute device of the parameters
    aliased: bool  # the masters are the fp32 parameter storage itself (no separate master buffer)
    master_flat: torch.Tensor | None
    masters: list[nn.Parameter]  # one fp32 leaf per bucket, what the optimizer steps
    frozen: bool = False  # stage 3's storage of parameters nobody trains (no masters: see stage3.py)

    def _master_pieces(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per-bucket views of a master-shaped buffer (a partition, or a full flat copy for stage 0)."""
        if self.partitioned:
            return self.layout.partition_views(buffer)
        return [self.layout.bucket_view(buffer, b) for b in range(len(self.layout.buckets))]

    def master_range(self, bucket: int) -> tuple[int, int]:
        """The flat ``[start, end)`` of the layout that ``masters[bucket]`` holds (checkpoints use this)."""
        if self.partitioned:
            return self.layout.shard_range(bucket, self.rank)
        b = self.layout.buckets[bucket]
        return b.start, b.end

    def master_shaped(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per-bucket views of ``buffer`` (partition-sized or flat-sized) lined up with ``masters``."""
        return self._master_pieces(buffer)

    def copy_masters_to_params(self) -> None:
        """Write the updated masters into this rank's compute-dtype parameter storage."""
        raise NotImplementedError

    def sixteen_bit_outputs(self) -> dict[torch.Tensor, torch.Tensor]:
        """master -> this rank's 16-bit parameter piece, for an optimizer kernel that writes the updated
        parameters in its own pass (``out_16bit``); empty when the parameters are fp32 or on another device."""
        raise NotImplementedError

    def numel_bytes(self) -> dict[str, int]:
        """Bytes held: {"params": ..., "master": ...}."""
        raise NotImplementedError

    # Per bucket, for the tile-by-tile step of NVMe offload (``OptimizerStep._apply_step_tiled`` in step.py).
    def copy_master_to_param(self, bucket: int) -> None:
        """Write ``masters[bucket]`` into this rank's compute-dtype parameter storage."""
        raise NotImplementedError

    def sixteen_bit_output(self, bucket: int) -> torch.Tensor | None:
        """Where an optimizer kernel may write ``masters[bucket]``'s updated 16-bit parameters (None: it
        cannot; ``copy_master_to_param`` follows the step instead)."""
        return None

    def store_sixteen_bit_output(self, bucket: int, out: torch.Tensor) -> None:
        """After the step: keep what the kernel wrote into ``sixteen_bit_output(bucket)``."""

    def materialize(self) -> None:
        """Bring swapped partitions into host memory (``ZeroStage.resident``); stage 3 overrides it."""

    def dematerialize(self) -> None:
        """Write them back to their swap file and drop them."""


class GroupState(GroupStorage):
    """Flat parameter buffer, masters and layout of one optimizer param group (stages 0-2)."""

    def __init__(
        self,
        index: int,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        coll: Collectives,
        bucket_numel: int,
        compute_dtype: torch.dtype,
        master_device: torch.device,
        partitioned: bool,
        pin_memory: bool = False,
        master_swap: OptimizerSwapper | None = None,
        whole_params: bool = False,
    ) -> None:
        self.index = index
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        self.partitioned = partitioned
        self.rank = coll.rank
        self.layout = FlatLayout.build(
            [(n, p.shape, p.dtype) for n, p in named_params],
            world_size=coll.world_size,
            bucket_numel=bucket_numel,
            whole_params=whole_params,
        )
        device = self.params[0].device if self.params else torch.device("cpu")
        self.device = device
        with torch.no_grad():
            # Gather the originals in fp32 (exact for fp32/bf16/fp16 inputs); rank 0's values win, like
            # DeepSpeed's start-up broadcast, so every rank begins from identical weights.
            full32 = torch.zeros(self.layout.total, dtype=torch.float32, device=device)
            for i, p in enumerate(self.params):
                self.layout.param_view(full32, i).copy_(p.detach())
            if full32.numel():  # an empty group has nothing to agree on (and no device of its own)
                coll.broadcast(full32)
            # NVMe offload swaps the masters out: they cannot be the parameters themselves.
            self.aliased = compute_dtype == torch.float32 and master_device == device and master_swap is None
            self.flat = full32 if compute_dtype == torch.float32 else full32.to(compute_dtype)
            if self.aliased:
                self.master_flat: torch.Tensor | None = None
                pieces = [self._own(self.flat, b) for b in range(len(self.layout.buckets))]
            else:
                numel = self.layout.partition_numel if partitioned else self.layout.total
                self.master_flat = torch.empty(numel, dtype=torch.float32, device=master_device, pin_memory=pin_memory)
                pieces = self._master_pieces(self.master_flat)
                for b, piece in enumerate(pieces):
                    piece.copy_(self._own(full32, b))
            del full32
            for i, p in enumerate(self.params):
                p.data = self.layout.param_view(self.flat, i)
        # One leaf per bucket for the optimizer; it aliases the storage above (see the notes).
        self.masters = [nn.Parameter(piece) for piece in pieces]
        if master_swap is not None:  # NVMe: the masters rest in the swap file (runtime/swap/optimizer.py)
            for b, master in enumerate(self.masters):
                master_swap.store((index, b), master.detach())
                master_swap.bind(master, (index, b), master.numel())
            self.master_flat = torch.empty(0, dtype=torch.float32, device=master_device)

    def _own(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """What this rank's master covers of ``bucket`` in a flat-layout tensor: its shard or all of it."""
        if self.partitioned:
            return self.layout.shard_view(flat, bucket, self.rank)
        return self.layout.bucket_view(flat, bucket)

    @torch.no_grad()
    def copy_masters_to_params(self) -> None:
        if self.aliased:
            return
        for b, master in enumerate(self.masters):
            self._own(self.flat, b).copy_(master.detach(), non_blocking=True)

    def sixteen_bit_outputs(self) -> dict[torch.Tensor, torch.Tensor]:
        if self.aliased or self.flat.dtype not in (torch.bfloat16, torch.float16):
            return {}
        if self.master_flat is None or self.flat.device != self.master_flat.device:
            return {}
        return {master: self._own(self.flat, b) for b, master in enumerate(self.masters)}

    @torch.no_grad()
    def copy_master_to_param(self, bucket: int) -> None:
        if not self.aliased:
            self._own(self.flat, bucket).copy_(self.masters[bucket].detach())

    def sixteen_bit_output(self, bucket: int) -> torch.Tensor | None:
        if self.aliased or self.flat.dtype not in (torch.bfloat16, torch.float16):
            return None
        if self.master_flat is None or self.flat.device != self.master_flat.device:
            return None
        return self._own(self.flat, bucket)

    def numel_bytes(self) -> dict[str, int]:
        master = 0 if self.master_flat is None else self.master_flat.numel() * self.master_flat.element_size()
        return {"params": self.flat.numel() * self.flat.element_size(), "master": master}


def param_fragment(gs: GroupStorage, index: int) -> tuple[int, int, int, int] | None:
    """(bucket, offset in its master, offset in the flattened parameter, numel) of parameter ``index``'s
    part on this rank, or None ([Note: where a parameter's state lives] in access.py)."""
    slot = gs.layout.params[index]
    lo, hi = gs.master_range(slot.bucket)
    a, z = max(lo, slot.offset), min(hi, slot.end)
    if a >= z:
        return None
    return slot.bucket, a - lo, a - slot.offset, z - a
