"""ZeRO++ (stage 3): how a partition is gathered and how its gradient is reduced, as properties of the
partition's group (``ZeroPP``), not branches in the engine.

[Note: ZeRO++]
- qwZ (``zero_quantized_weights``): a bucket's all-gather sends each rank's shard as block-wise int8
  values + fp32 scales (``WEIGHT_BLOCK`` elements per scale, ops/quant.py) and every rank dequantizes the
  gathered rows into the bucket, its own shard included, so all ranks compute with identical weights. A
  re-gather in backward re-quantizes the same shard to the same bytes: forward and backward see the same
  weights. The fp32 masters and the partitions stay exact; only what travels is quantized.
- Quantized frozen weights (``zero_quantized_nontrainable_weights``): the partitions of the frozen
  storage (a LoRA run's base) *rest* as int8 + scales (about a quarter of bf16's bytes plus 4 bytes per
  block) and are gathered as such (no re-quantization); ``resident`` blocks (checkpoints, full-state access)
  see them dequantized in the compute dtype.
- hpZ (``zero_hpz_partition_size`` = h > 1): the ranks form groups of h consecutive ranks (a node). When
  a bucket is gathered from the primary partition (over every rank), each rank keeps its 1/h slice of the
  gathered bucket as a *secondary* shard; later gathers of that bucket (backward, the next micro-batch's
  forward) all-gather the secondary shards inside the group only. The secondaries are dropped when the
  parameters change (the optimizer step, a GatheredParameters edit, a checkpoint load). Memory: 1/h of
  every bucket gathered since the last step, on top of the 1/W primary partition.
- qgZ (``zero_quantized_gradients``): a bucket's gradient reduce-scatter becomes the hierarchical
  quantized all-to-all of comm/quantized_all_to_all.py over the node groups (hpZ's groups when h > 1,
  else the ranks sharing a host name when the hosts hold equal consecutive blocks of ranks, else one
  level): int4 inside a node, int8 across nodes (the partial sums that cross nodes carry a node's
  accumulated error, so they get the finer format), fp32 accumulation at every landing; one node: a single
  int8 all-to-all.

The node groups are ``torch.distributed.new_group``s, which every rank of the default group builds in
the same order: ZeRO++'s groups need the engine on the default group (or every rank building one).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_strategy.comm.ownership import GroupSet
from ds_strategy.comm.quantized_all_to_all import quantized_reduce_scatter
from ds_strategy.config.errors import ConfigError, ConfigProblem
from ds_strategy.ops.quant import Quantized, dequantize_into, num_blocks, packed_numel, quantize

from .collectives import Collectives, Handle, advance

WEIGHT_BLOCK = 256  # elements per fp32 scale in weight gathers and quantized frozen partitions
GRAD_BLOCK = 256  # ... and in gradient all-to-alls
WEIGHT_BITS = 8
GRAD_INTRA_BITS = 4
GRAD_INTER_BITS = 8


@dataclass
class ZeroPP:
    """The ZeRO++ settings of one stage-3 engine and the process groups they need."""

    quantized_weights: bool = False
    quantized_frozen: bool = False
    hpz: Collectives | None = None  # this rank's secondary-partition group (hpZ), None: off
    grad_intra: Collectives | None = None  # qgZ: this rank's node group ...
    grad_inter: Collectives | None = None  # ... and its cross-node group; both None: qgZ off
    owned: GroupSet | None = field(default=None, repr=False, compare=False)  # the node groups, created here

    @property
    def quantized_grads(self) -> bool:
        return self.grad_intra is not None

    @classmethod
    def from_config(cls, zero: Any, coll: Collectives) -> ZeroPP | None:
        hpz_size = int(getattr(zero, "zero_hpz_partition_size", 1) or 1)
        qgz = bool(getattr(zero, "zero_quantized_gradients", False))
        out = cls(
            quantized_weights=bool(getattr(zero, "zero_quantized_weights", False)),
            quantized_frozen=bool(getattr(zero, "zero_quantized_nontrainable_weights", False)),
        )
        world = coll.world_size
        if hpz_size > 1 and world % hpz_size:
            raise ConfigError(
                [
                    ConfigProblem(
                        "zero_optimization.zero_hpz_partition_size",
                        f"got {hpz_size}; it must divide the data-parallel world size {world} (ranks per node, e.g. "
                        f"{_divisors(world)})",
                    )
                ]
            )
        if (hpz_size > 1 or qgz) and world > 1:
            node = hpz_size if hpz_size > 1 else _host_node_size(coll)
            out.owned = GroupSet(out)  # destroyed by close() and at exit
            intra, inter = node_groups(coll, node, out.owned)
            if hpz_size > 1 and hpz_size < world:
                out.hpz = intra
            if qgz:
                out.grad_intra, out.grad_inter = intra, inter
        elif qgz:  # a group of one: nothing travels, the reduction is local
            out.grad_intra = out.grad_inter = coll
        if not (out.quantized_weights or out.quantized_frozen or out.hpz is not None or out.quantized_grads):
            return None
        return out

    def close(self) -> None:
        for c in {id(c): c for c in (self.hpz, self.grad_intra, self.grad_inter) if c is not None}.values():
            c.close()
        if self.owned is not None:
            self.owned.destroy()

    # ------------------------------------------------------------------ qgZ
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle:
        """``output`` = this rank's shard of the group-wide sum of ``input`` through quantized all-to-alls;
        with ``async_op`` they overlap with what the caller does until ``wait``; across nodes the second is
        issued by ``advance`` ([Note: when step 2 is issued] in comm/quantized_all_to_all.py)."""
        assert self.grad_intra is not None and self.grad_inter is not None
        one_node = self.grad_inter.world_size == 1
        handle = quantized_reduce_scatter(
            output,
            input,
            intra=self.grad_intra,
            inter=self.grad_inter,
            block_size=GRAD_BLOCK,
            intra_bits=8 if one_node else GRAD_INTRA_BITS,
            inter_bits=GRAD_INTER_BITS,
            async_op=async_op,
        )
        return _Then(handle, None)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(2, n + 1) if n % d == 0) or "1"


def _host_node_size(coll: Collectives) -> int:
    """Ranks per host when the group is laid out host by host in equal blocks (as launchers place ranks),
    else the whole group (one level). A collective over ``coll``'s group."""
    hosts: list[Any] = [None] * coll.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=coll.group)
    size = hosts.count(hosts[0])
    blocks = [hosts[i : i + size] for i in range(0, coll.world_size, size)]
    if (
        coll.world_size % size == 0
        and all(len(set(b)) == 1 for b in blocks)
        and len({b[0] for b in blocks}) == len(blocks)
    ):
        return size
    return coll.world_size


def node_groups(coll: Collectives, node: int, owned: GroupSet | None = None) -> tuple[Collectives, Collectives]:
    """(this rank's node group of ``node`` consecutive ranks, its cross-node group of the ranks with its local
    index) as communicators sharing ``coll``'s logger; ``owned`` records the groups (None: a set of their own,
    destroyed at exit). Every rank of the default group must call it."""
    owned = GroupSet() if owned is None else owned
    world = coll.world_size
    ranks = dist.get_process_group_ranks(coll.group) if coll.group is not None else list(range(world))
    mine_intra = mine_inter = None
    for start in range(0, world, node):
        group = owned.new_group([ranks[i] for i in range(start, start + node)])
        if start <= coll.rank < start + node:
            mine_intra = group
    for local in range(node):
        group = owned.new_group([ranks[i] for i in range(local, world, node)])
        if coll.rank % node == local:
            mine_inter = group
    return Collectives(mine_intra, logger=coll.logger), Collectives(mine_inter, logger=coll.logger)


# ---------------------------------------------------------------------- qwZ
def wire_numel(shard_numel: int) -> int:
    """fp32 words one rank's quantized shard takes on the wire (int8 bytes padded to 4, then the scales)."""
    return -(-packed_numel(shard_numel, WEIGHT_BITS) // 4) + num_blocks(shard_numel, WEIGHT_BLOCK)


def quantize_shard(shard: torch.Tensor) -> Quantized:
    return quantize(shard, WEIGHT_BLOCK, WEIGHT_BITS)


def quantized_all_gather(
    coll: Collectives, full: torch.Tensor, mine: Quantized, *, async_op: bool, tag: int = 0
) -> Handle:
    """All-gather every rank's quantized shard and dequantize the rows into ``full`` (W x shard) on wait.

    The payload travels as fp32 words (the int8 bytes, padded to 4, then the scales) so it takes the same
    path as an unquantized gather (shared memory on one node); every path moves or sums those words
    bit-exactly (see [Note: gloo reduce_scatter and all_gather through all_reduce])."""
    world = coll.world_size
    n = full.numel() // world
    qbytes = packed_numel(n, WEIGHT_BITS)
    words = wire_numel(n)
    wire = torch.empty(world * words, dtype=torch.float32, device=full.device)
    row = wire.view(world, words)[coll.rank].view(torch.uint8)
    row[:qbytes].copy_(mine.q.view(torch.uint8))
    pad = -(-qbytes // 4) * 4
    row[qbytes:pad].zero_()
    row[pad:].copy_(mine.scales.view(torch.uint8))
    handle = coll.all_gather(wire, wire.view(world, words)[coll.rank], async_op=async_op, tag=tag)

    def land() -> None:
        rows = wire.view(world, words).view(torch.uint8)
        q = rows[:, :qbytes].contiguous().view(torch.int8)
        scales = rows[:, pad:].contiguous().view(torch.float32)
        dequantize_into(Quantized(q, scales, WEIGHT_BLOCK, WEIGHT_BITS), full.view(world, n))

    return _Then(handle, land)


class _Then:
    """A handle that runs ``then`` once after the collective completes."""

    __slots__ = ("_handle", "_then")

    def __init__(self, handle: Handle | None, then: Callable[[], None] | None) -> None:
        self._handle, self._then = handle, then

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def is_completed(self) -> bool:
        return self._handle is None or self._handle.is_completed()

    def advance(self) -> None:
        if self._handle is not None:
            advance(self._handle)


def then(handle: Handle, action: Callable[[], None]) -> Handle:
    return _Then(handle, action)
