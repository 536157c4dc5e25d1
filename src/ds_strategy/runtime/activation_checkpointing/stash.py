"""The inputs a checkpointed call keeps for its recomputation, and how (DeepSpeed's three options).

- ``partition_activations`` (with a model-parallel group of size > 1): each floating-point input is split
  into equal flat chunks across the group; this rank keeps its chunk, and the recomputation all-gathers
  the whole tensor back. Every rank of the group runs the same checkpoints, so the gathers pair up.
- ``cpu_checkpointing``: the kept inputs (whole or partitioned) move to host memory and come back to their
  device for the recomputation.
- ``contiguous_memory_optimization``: partitions are copied into buffers allocated once per checkpoint
  index (``number_checkpoints`` of them per forward) and reused every iteration, so the allocator never
  fragments around them; ``reset()`` rewinds the index at each forward.

Non-floating inputs (masks, ids) and non-tensors are kept as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .options import ModelParallelUnit, Settings, tell_once


@dataclass
class _Kept:
    """One stashed tensor: the chunk (or whole tensor) and what rebuilds it."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool


@dataclass(frozen=True)
class _Plain:
    index: int


class ContiguousBuffers:
    """Per (checkpoint index, input position): one buffer reused every iteration."""

    def __init__(self) -> None:
        self.index = 0
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}

    def reset(self) -> None:
        self.index = 0

    def clear(self) -> None:
        self.index = 0
        self._buffers.clear()

    def next_index(self, limit: int) -> int:
        if self.index >= limit:
            raise RuntimeError(
                f"this forward ran more than activation_checkpointing.number_checkpoints = {limit} checkpointed "
                "calls; raise number_checkpoints to the number of checkpointed calls per forward (the engine "
                "rewinds the count at every forward; without the engine call ds_strategy.checkpointing.reset())"
            )
        self.index += 1
        return self.index - 1

    def place(self, index: int, position: int, chunk: torch.Tensor) -> torch.Tensor:
        key = (index, position)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != chunk.numel() or buf.dtype != chunk.dtype or buf.device != chunk.device:
            buf = torch.empty_like(chunk)
            self._buffers[key] = buf
        return buf.copy_(chunk)


BUFFERS = ContiguousBuffers()


def _is_activation(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class Stash:
    """The inputs of one checkpointed call, kept as the settings say until ``restore()``."""

    def __init__(self, args: tuple[Any, ...], settings: Settings, mpu: ModelParallelUnit | None) -> None:
        self._mpu = mpu if settings.partition_activations else None
        to_cpu = settings.checkpoint_in_cpu
        if to_cpu and any(_is_activation(a) and a.device.type == "cpu" for a in args):
            tell_once(
                "cpu-on-cpu",
                "activation_checkpointing.cpu_checkpointing moves checkpoint inputs to host memory; these already "
                "live there (CPU training), so it changes nothing here",
            )
        index = BUFFERS.next_index(settings.num_checkpoints or 0) if settings.contiguous_checkpointing else None
        self._items: list[Any] = []
        self.plain: list[torch.Tensor] = []  # tensors kept as they are (the reentrant path saves them for backward)
        for position, a in enumerate(args):
            if isinstance(a, torch.Tensor) and (
                not a.is_floating_point() or (self._mpu is None and (not to_cpu or a.device.type == "cpu"))
            ):
                self._items.append(_Plain(len(self.plain)))
                self.plain.append(a)
                continue
            if not isinstance(a, torch.Tensor):
                self._items.append(a)
                continue
            data, partitioned = a.detach(), False
            if self._mpu is not None:
                data, partitioned = self._own_chunk(data), True
            if to_cpu and data.device.type != "cpu":
                data = data.to("cpu", non_blocking=False)
            elif index is not None and partitioned:
                data = BUFFERS.place(index, position, data)
            self._items.append(_Kept(data, a.shape, a.device, a.requires_grad, partitioned))
        # Per input: did the original require grad (its recomputed copy must, to get a gradient).
        self.requires_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]

    def _own_chunk(self, t: torch.Tensor) -> torch.Tensor:
        assert self._mpu is not None
        size, rank = self._mpu.get_model_parallel_world_size(), self._mpu.get_model_parallel_rank()
        flat = t.reshape(-1)
        per = math.ceil(flat.numel() / size)
        padded = torch.nn.functional.pad(flat, (0, per * size - flat.numel()))
        return padded[rank * per : (rank + 1) * per].clone()

    def restore(self, plain: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> list[Any]:
        """The inputs as they were, gathering partitions; ``plain``: the tensors kept as they are (as the
        caller got them back from autograd's saved tensors, or ``self.plain``)."""
        out: list[Any] = []
        for item in self._items:
            if isinstance(item, _Plain):
                out.append(plain[item.index])
                continue
            if not isinstance(item, _Kept):
                out.append(item)
                continue
            data = item.data.to(item.device)
            if item.partitioned:
                data = self._gather(data, item.shape)
            out.append(data.view(item.shape))
        return out

    def _gather(self, chunk: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        assert self._mpu is not None
        size = self._mpu.get_model_parallel_world_size()
        parts = [torch.empty_like(chunk) for _ in range(size)]
        dist.all_gather(parts, chunk.contiguous(), group=self._mpu.get_model_parallel_group())
        return torch.cat(parts)[: math.prod(shape)]

    def drop_plain(self) -> None:
        """The reentrant path holds the plain tensors as saved tensors; the stash need not."""
        self.plain = []
