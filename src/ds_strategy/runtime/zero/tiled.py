"""Stage 3's tiled frozen weights: a large frozen ``nn.Linear`` or ``nn.Embedding`` weight is computed
tile by tile, never gathered whole.

[Note: tiled frozen weights]
In a LoRA (or other adapter) fine-tune of a large-vocabulary model the frozen embedding and output head
are each several times a transformer block (Llama-3-8B: 128256 x 4096 = 525M parameters against 218M a
block; the 63M Llama of benchmarks/bench_lora_lightning.py: 4x). Gathering such a weight whole for its
forward (and again for the head's backward, whose input gradient reads the weight) makes the largest thing
a rank holds the very weight partitioning was meant to spread: on 2 CPU ranks that 63M model's peak
saved 30% of what partitioning its frozen base should save (62% tiled).

So a unit module that is exactly an ``nn.Linear`` without bias or an ``nn.Embedding`` without ``max_norm``,
whose weight is frozen, alone in its bucket, used by no other module, and larger than ``REST_SPLIT`` times
the largest other unit, is *tiled* (``stage3_tile_frozen``, default on; never at world size 1, where the
gathered bucket is the partition): it has no fetch unit (nothing gathers it, nothing prefetches it); its
forward pre-hook enters ``TiledCalls``, a torch function mode that catches the module's own
``F.linear`` / ``F.embedding`` call on that weight and computes it from tiles: tile ``j`` is one
all-gather of the elements ``[j*t, (j+1)*t)`` of every rank's shard, i.e. ``W`` flat segments of the
weight, each split into whole rows (a matmul or a row lookup) and at most two partial rows (a partial dot
product, the two parts of a row summed in fp32). The next tile is gathered while the current one is used,
the two in the halves of one buffer with a gathered block's bytes (``t`` is half the largest other
bucket's shard): the host pool, keyed by size, serves it from the blocks' buffers, and a tiled call holds
what one gathered block does.
The Linear's backward (the gradient w.r.t. its input; the weight takes none) gathers the tiles again.
Any other call that reads the weight inside the module's forward gathers it whole for the rest of that
forward (correct, just not tiled). Held or otherwise gathered buckets (the hybrid engine, a
``GatheredParameters``) are used as they are. Results equal the whole-weight call up to the summation
order of a row split over two segments (fp32: ~1e-7 relative); lookups are exact. No host read is made:
masks select with ``torch.where``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import host_memory
from ..layout import BucketKey
from .collectives import Collectives
from .sharded import ShardedGroup
from .units import REST_SPLIT

_LINEAR = {F.linear}  # torch._C._nn.linear itself
_EMBEDDING = {F.embedding}


@dataclass(eq=False)
class TiledWeight:
    """One tiled weight: where it lies in its bucket and how its tiles are cut."""

    module: nn.Module
    weight: nn.Parameter
    key: BucketKey
    group: ShardedGroup
    rows: int  # out_features (Linear) / num_embeddings (Embedding)
    cols: int  # in_features / embedding_dim
    start: int  # the weight's first element in the bucket's flat buffer
    shard: int  # the bucket's elements on each rank
    tile: int  # elements of each rank's shard per tile
    span: int = 0  # elements per rank of the call's one buffer (2 tiles or more): the largest other bucket's shard

    @property
    def live(self) -> bool:
        """The bucket is gathered whole now (held, acquired): the call needs no tiles."""
        return bool(self.group.live[self.key[1]])

    def tiles(self, coll: Collectives, tag: int) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Each tile as its segments ``(first flat index in the weight, values)``; tile ``j+1``'s all-gather
        is in flight while tile ``j`` is used. Both live in the two halves of one buffer taken for the call
        (tile ``j+2`` overwrites tile ``j`` only once tile ``j+1`` is asked for; on CUDA the collective is
        ordered after the compute stream's reads of it)."""
        part = self.group.rest.resident(self.key[1])
        assert part is not None, "a tiled weight's partition rests in memory (see tiled_weights)"
        world, numel = coll.world_size, self.rows * self.cols
        starts = list(range(0, self.shard, self.tile))
        buf = host_memory.unallocated(world * self.span, part.dtype, part.device)
        host_memory.allocate(buf)

        def issue(j: int) -> tuple[int, int, torch.Tensor, Any]:
            lo = starts[j]
            n = min(self.tile, self.shard - lo)
            half = buf[(j % 2) * world * self.tile :][: world * n]
            return lo, n, half, coll.all_gather(half, part[lo : lo + n], async_op=True, tag=tag)

        try:
            pending = issue(0)
            for j in range(len(starts)):
                lo, n, tile, handle = pending
                if j + 1 < len(starts):
                    pending = issue(j + 1)
                handle.wait()
                segments = []
                for r in range(world):
                    a = r * self.shard + lo - self.start  # the segment's first element in the weight
                    a0, z0 = max(a, 0), min(a + n, numel)
                    if a0 < z0:
                        segments.append((a0, tile[r * n + a0 - a : r * n + z0 - a]))
                yield segments
        finally:
            host_memory.release(buf)


def pieces(first: int, values: torch.Tensor, cols: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """A flat segment of a row-major ``[rows, cols]`` weight as ``(row, col, values)``: whole rows as one
    2-D block (``col`` 0), a partial row at either end as 1-D values starting at ``col``."""
    end, pos = first + values.numel(), first
    if pos % cols:
        row, z = pos // cols, min(end, (pos // cols + 1) * cols)
        yield row, pos % cols, values[: z - first]
        pos = z
    whole = (end - pos) // cols
    if whole:
        yield pos // cols, 0, values[pos - first : pos - first + whole * cols].view(whole, cols)
        pos += whole * cols
    if pos < end:
        yield pos // cols, 0, values[pos - first :]


class TileSource(Protocol):
    """What the tiled calls need from the gatherer (``ParamGatherer``)."""

    coll: Collectives

    def tile_label(self, module: nn.Module) -> int: ...

    def acquire(self, keys: Sequence[BucketKey], label: str) -> None: ...

    def release_keys(self, keys: Sequence[BucketKey]) -> None: ...


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """What ``F.linear`` would compute in: autocast's dtype where autocast is on, else the input's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _TiledLinear(torch.autograd.Function):
    """``x @ weight.T`` from the tiles; the backward gathers them again for ``grad_x`` (the weight is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tw: TiledWeight, source: TileSource) -> torch.Tensor:
        dtype = _compute_dtype(x)
        # weakly: a graph kept past its step must not keep the engine's groups alive ([Note: the graph holds
        # the hooks weakly] in module_hooks.py)
        ctx.tw, ctx.source, ctx.dtype, ctx.x_dtype = weakref.ref(tw), weakref.ref(source), dtype, x.dtype
        xc = x.to(dtype)
        out = xc.new_zeros(*x.shape[:-1], tw.rows)
        split: dict[int, torch.Tensor] = {}  # rows split over two segments: summed in fp32, rounded once
        with torch.autocast(x.device.type, enabled=False):
            for segments in tw.tiles(source.coll, source.tile_label(tw.module)):
                for first, values in segments:
                    for row, col, w in pieces(first, values.to(dtype), tw.cols):
                        if w.dim() == 2:
                            out[..., row : row + w.shape[0]] = xc @ w.t()
                        else:
                            part = (xc[..., col : col + w.numel()] @ w).float()
                            split[row] = split[row] + part if row in split else part
            for row, total in split.items():
                out[..., row] = total
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        tw, source, dtype = ctx.tw(), ctx.source(), ctx.dtype
        if tw is None or source is None:
            raise RuntimeError(
                "ZeRO stage 3: backward through a tiled frozen weight after its engine was destroyed; run "
                "backward before engine.destroy() (or the end of Trainer.fit)"
            )
        g = grad.to(dtype)
        gx = g.new_zeros(*g.shape[:-1], tw.cols, dtype=torch.float32)  # one rounding, as one matmul's
        for segments in tw.tiles(source.coll, source.tile_label(tw.module)):
            for first, values in segments:
                for row, col, w in pieces(first, values.to(dtype), tw.cols):
                    if w.dim() == 2:
                        gx += g[..., row : row + w.shape[0]] @ w
                    else:
                        gx[..., col : col + w.numel()] += g[..., row : row + 1] * w
        return gx.to(ctx.x_dtype), None, None


@torch.no_grad()
def tiled_embedding(ids: torch.Tensor, tw: TiledWeight, source: TileSource) -> torch.Tensor:
    """``weight[ids]`` from the tiles: each tile's rows are selected where ``ids`` fall in them."""
    # An id outside [0, rows) would match no tile and read as a zero row; torch's embedding refuses it. Checked
    # on the device (raised at once on the CPU, a device assert on a GPU): no host read inside the step.
    torch._assert_async(
        ((ids >= 0) & (ids < tw.rows)).all(),
        f"index out of range in self: {type(tw.module).__name__} has {tw.rows} rows (ids must be in [0, {tw.rows}))",
    )
    out: torch.Tensor | None = None
    for segments in tw.tiles(source.coll, source.tile_label(tw.module)):
        for first, values in segments:
            if out is None:
                out = values.new_zeros(*ids.shape, tw.cols)
            for row, col, w in pieces(first, values, tw.cols):
                if w.dim() == 2:
                    at = ids - row
                    inside = ((at >= 0) & (at < w.shape[0])).unsqueeze(-1)
                    out = torch.where(inside, w[at.clamp(0, w.shape[0] - 1)], out)
                else:
                    cut = out[..., col : col + w.numel()]
                    cut.copy_(torch.where((ids == row).unsqueeze(-1), w, cut))
    assert out is not None
    return out


class TiledCalls(TorchFunctionMode):
    """Entered around a tiled module's forward (its hooks): computes the module's call on its weight from
    tiles (see [Note: tiled frozen weights]); any other call reading the weight gathers it whole until the
    module's forward ends."""

    def __init__(self, source: TileSource) -> None:
        super().__init__()
        self.source = source
        self.active: dict[int, TiledWeight] = {}  # id(weight) -> its tiling, while its module runs
        self.whole: list[BucketKey] = []  # gathered whole by a call that is not the module's own
        self.entered: list[TiledWeight] = []  # the tiled modules whose forward runs now, innermost last

    def enter(self, tw: TiledWeight) -> None:
        self.active[id(tw.weight)] = tw
        self.entered.append(tw)
        if len(self.entered) == 1:
            self.__enter__()

    def exit(self) -> None:
        """The module entered last ends its forward."""
        if not self.entered:
            return
        tw = self.entered.pop()
        if all(t is not tw for t in self.entered):
            self.active.pop(id(tw.weight), None)
        if not self.entered:
            self.__exit__(None, None, None)
            whole, self.whole = self.whole, []
            self.source.release_keys(whole)

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _LINEAR or func in _EMBEDDING:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            tw = self.active.get(id(weight))
            if tw is not None and not tw.live:
                x = args[0] if args else kwargs["input"]
                if func in _LINEAR and (args[2] if len(args) > 2 else kwargs.get("bias")) is None:
                    return _TiledLinear.apply(x, tw, self.source)
                rest = {k: v for k, v in kwargs.items() if k not in ("input", "weight")}
                if func in _EMBEDDING and len(args) <= 2 and rest.get("max_norm") is None:
                    return tiled_embedding(x, tw, self.source)
        for tw in self._read_by(args, kwargs):
            self.source.acquire([tw.key], f"{type(tw.module).__name__} weight, gathered whole")
            self.whole.append(tw.key)
        return func(*args, **kwargs)

    def _read_by(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[TiledWeight]:
        """The active tiled weights, not gathered now, among a call's arguments (one level deep)."""
        found = []
        for value in (*args, *kwargs.values()):
            tw = self.active.get(id(value)) if isinstance(value, torch.Tensor) else None
            if tw is not None and not tw.live and tw.key not in self.whole:
                found.append(tw)
        return found


def tiled_weights(
    root: nn.Module,
    units: Mapping[int, list[BucketKey]],
    groups: Sequence[ShardedGroup],
    readers: Mapping[int, int],
) -> dict[int, TiledWeight]:
    """``id(module)`` -> its tiling, for the unit modules that qualify (see [Note: tiled frozen weights]);
    ``readers``: ``id(parameter)`` -> the modules reading it, its owners and those holding it as external."""
    candidates: dict[int, TiledWeight] = {}
    for m in root.modules():
        keys = units.get(id(m))
        if not keys or len(keys) != 1 or m is root:
            continue
        if type(m) is nn.Linear:
            if m.bias is not None:
                continue
        elif type(m) is nn.Embedding:
            if m.max_norm is not None:
                continue
        else:
            continue
        weight = m.weight
        g, b = keys[0]
        gs = groups[g]
        bucket = gs.layout.buckets[b]
        if (
            weight.requires_grad
            or not gs.frozen
            or gs.coll.world_size == 1
            or b in gs.in_place
            or readers.get(id(weight), 0) != 1
            or len(bucket.params) != 1  # an external parameter of the module would be a second one
            or gs.params[bucket.params[0]] is not weight
            or gs.rest.resident(b) is None
        ):
            continue
        slot = gs.layout.params[bucket.params[0]]
        rows, cols = slot.shape[0], slot.numel // max(slot.shape[0], 1)
        tw = TiledWeight(m, weight, (g, b), gs, rows, cols, slot.offset - bucket.start, bucket.shard, 0)
        candidates[id(m)] = tw
    if not candidates:
        return {}
    others = [[groups[g].layout.buckets[b] for g, b in keys] for mid, keys in units.items() if mid not in candidates]
    largest = max((sum(b.padded for b in unit) for unit in others), default=0)
    # A call's two tiles in flight share one buffer with the largest other bucket's bytes, which the host pool
    # (exact sizes) then reuses for both: the tiled call holds what one gathered unit does, and the last
    # block kept for its backward plus the head's tiles fit in what a unit and its prefetch take.
    shard = max((b.shard for unit in others for b in unit), default=0)
    out = {}
    for mid, tw in candidates.items():
        if largest and tw.rows * tw.cols > REST_SPLIT * largest:
            tw.tile = max(1, min(shard // 2, tw.shard))
            tw.span = max(shard, 2 * tw.tile)
            out[mid] = tw
    return out
