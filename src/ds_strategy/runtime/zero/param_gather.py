"""Stage 3's parameter gatherer: gathers a module's parameters before its forward and backward, frees them
after, prefetches along the recorded execution order, and holds buckets for the hybrid engine.

[Note: gather units and hooks]
A module's *unit* is the set of (group, bucket) keys holding its direct, partitioned parameters (buckets
are module-aligned, see stage3.py), plus any registered external parameters (and, for torch modules that
read their children's weights directly, like ``nn.MultiheadAttention``, the whole subtree). A leaf
module's unit is its whole subtree and its descendants have none (see [Note: leaf modules] in leaf.py).
A forward pre-hook gathers the unit and counts a user; the forward hook drops the user and frees the
buckets (unless a later use is near, see [Note: prefetch order] in prefetch.py), and registers - on the
forward's output tensors - a multi-grad hook that gathers the unit again when the gradient w.r.t. those
outputs is ready, i.e. just before the module's backward.
In backward a bucket is freed as soon as all of its parameters' gradients have been accumulated (the
post-accumulate-grad hook that also feeds the reduce-scatter), which is also after the last use of a
tied or reused parameter; ``end_backward`` frees whatever is left. Persistent buckets are never freed.

[Note: held buckets]
The hybrid engine's generate (runtime/hybrid.py) gathers every partitioned bucket once, ``in_flight``
buckets in flight at a time, and *holds* them: while anything is held the module hooks are removed (no
gather, no release, no divergence label: ranks may run different numbers of forwards, so generation
needs no ``synced_gpus``; removed rather than made to return early, because a module with no hooks takes
torch's fast call path: hooks that only return cost a 64-token generation ~15% on a GPU, where each
decoding step is launch-bound), and ``free`` leaves held buckets alone, so a training forward and backward
under a pinned hold (``pin_parameters``) read the held copy and its post-accumulate-grad frees are moot.
``unhold`` ends it (after generate, or before the optimizer step updates the partitions the held copy
was gathered from), puts the hooks back if they were attached, and frees the buckets.

The pieces: unit_map.py computes the units; module_hooks.py holds the hooks ([Note: frozen buckets in
backward], [Note: compiled regions]); prefetch.py holds the recorded order and the prefetch, reuse and
live-limit decisions ([Note: prefetch order], [Note: reshard after use]); divergence.py detects ranks running
different modules. This module gathers, waits for and frees the buckets.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ds_strategy import env
from ds_strategy.accelerator.spans import span

from .. import host_memory
from ..layout import BucketKey
from .collectives import Collectives, Handle
from .divergence import DivergenceCheck
from .module_hooks import ModuleHooks
from .prefetch import PrefetchPlanner
from .sharded import ShardedGroup
from .streams import GatherStream
from .tiled import TiledCalls
from .unit_map import EXTERNAL_ATTR, UnitMap
from .units import MODULES, FetchUnitPolicy

__all__ = ["EXTERNAL_ATTR", "TIMEOUT_ENV", "ParamGatherer"]

TIMEOUT_ENV = env.GATHER_TIMEOUT


class ParamGatherer:
    """Gathers and frees stage 3's buckets around module forwards and backwards (see the notes). Its parts:
    ``unit_map`` (what each module gathers), ``hooks`` (when), ``planner`` (what else, ahead or kept)."""

    def __init__(
        self,
        groups: Sequence[ShardedGroup],
        root: nn.Module,
        coll: Collectives,
        *,
        prefetch_numel: int | None,
        max_live_numel: int,
        reuse_distance: int | None,
        timeout_s: float | None = None,
        policy: FetchUnitPolicy = MODULES,
        tile_frozen: bool = False,
    ) -> None:
        self.groups = groups
        self.root = root
        self.coll = coll
        # The headers travel where the gathered buckets do: the compute device (NCCL takes nothing else).
        self.device = next((gs.device for gs in groups if gs.full), torch.device("cpu"))
        self.stream = GatherStream(self.device)  # [Note: gather stream] in streams.py
        configured = env.get(TIMEOUT_ENV)
        self.timeout_s = float(configured) if configured else timeout_s
        self.names: dict[int, str] = {}
        self.index: dict[int, int] = {}
        for n, (name, m) in enumerate(root.named_modules()):
            self.names[id(m)] = name or "<root>"
            self.index[id(m)] = n
        self.unit_map = UnitMap(groups, root, policy, tile_frozen=tile_frozen)
        self.units = self.unit_map.units  # the same dict, updated in place
        self.tiles = TiledCalls(self)  # [Note: tiled frozen weights] in tiled.py
        probe = next((gs.full[0] for gs in groups if gs.full), None)  # what a bucket gather looks like
        self.divergence = DivergenceCheck(coll, self.device, probe, self.names, self.index, self.timeout_s)
        self.users: dict[BucketKey, int] = defaultdict(int)
        self.inflight: dict[BucketKey, _Gather] = {}
        # module id -> the label of its backward fetch whose prefetch is to come ([Note: prefetch after release])
        self.deferred: dict[int, int] = {}
        self.held: set[BucketKey] = set()  # see [Note: held buckets]
        self.planner = PrefetchPlanner(
            self.units,
            self,
            prefetch_numel=prefetch_numel,
            max_live_numel=max_live_numel,
            reuse_distance=reuse_distance,
        )
        self.hooks = ModuleHooks(root, self.units, self.unit_map.frozen_units, self, self.unit_map.tiled)
        self.gathers = 0  # bucket all-gathers issued (for tests and reports) ...
        self.misses = 0  # ... fetches that found a bucket neither gathered nor prefetched ...
        self.peak_live = 0  # ... and the most partitioned-bucket elements gathered at once
        self.gave_back = False  # the forward's end gave back the idle host memory ([Note: the loss's peak])

    # ------------------------------------------------------------------ set-up (the hooks: module_hooks.py)
    def add_external(self, module: nn.Module, param: torch.Tensor) -> None:
        """Gather ``param`` whenever ``module`` runs (``register_external_parameter``, which has recorded it on
        ``module`` already)."""
        self.unit_map.compute()
        self.hooks.rehook()  # ``module`` may have had no unit, hence no hooks, until now

    def attach(self) -> None:
        self.hooks.attach()

    def detach(self) -> None:
        self.hooks.detach()

    def unhook_inside(self, regions: Iterable[nn.Module]) -> None:
        """See [Note: compiled regions] in module_hooks.py."""
        self.hooks.unhook_inside(regions)

    @property
    def suspended(self) -> bool:
        """Whether a hold has the hooks removed (see [Note: held buckets])."""
        return self.hooks.suspended

    # ------------------------------------------------------------------ the buckets' state
    def numel(self, key: BucketKey) -> int:
        return self.groups[key[0]].full[key[1]].numel()

    def live(self, key: BucketKey) -> bool:
        return self.groups[key[0]].live[key[1]]

    def live_numel(self) -> int:
        return sum(gs.live_numel() for gs in self.groups)

    # ------------------------------------------------------------------ gather / release
    def begin_forward(self) -> None:
        """The root's forward starts: follow leaf flag changes (a new record if a unit changed), start the
        planner's pass, free what no module uses."""
        if self.unit_map.refresh():
            self.planner.forget()
            self.hooks.rehook()  # other modules may be units now (the root's own hooks are running: kept)
        self.planner.begin()
        self.gave_back = False
        for key in [k for k, n in self.users.items() if n <= 0]:
            self.free(key)

    def fetch(self, module: nn.Module, *, prefetch: bool = True) -> None:
        """Gather ``module``'s unit (and prefetch the next ones, unless ``prefetch`` is False: then
        ``prefetch_after`` does, see [Note: prefetch after release]); count a user of each of its buckets."""
        keys = self.units.get(id(module))
        if not keys:
            return
        with span(lambda: f"ds::gather[{self.names.get(id(module), '?')}]"):
            self.planner.advance(id(module))
            need = [k for k in keys if not self.live(k) and k not in self.inflight]
            if need:
                self.planner.make_room(sum(self.numel(k) for k in need), protect=set(keys))
            tag = self.divergence.label(id(module), blocking=bool(need))
            for k in need:
                self.inflight[k] = self._gather(k, tag, id(module))
                self.gathers += 1
            self.misses += bool(need)
            self.deferred[id(module)] = tag
            if prefetch:  # issued before waiting for the unit: the next one's gather overlaps this compute
                self.prefetch_after(module)
            self.peak_live = max(self.peak_live, self.live_numel())
            for k in keys:
                handle = self.inflight.pop(k, None)
                if handle is not None:
                    handle.wait()
                self.users[k] += 1

    def prefetch_after(self, module: nn.Module) -> None:
        """Gather ahead what the recorded order needs next (see [Note: prefetch order]), for the last fetch of
        ``module``: at once, or from the hook that ``fetch(prefetch=False)`` left for it."""
        tag = self.deferred.pop(id(module), None)
        keys = self.units.get(id(module))
        if tag is None or not keys:
            return
        plan = self.planner.plan(set(keys), 0)  # the unit's own buckets are live (gathered or in flight)
        if plan:
            self.planner.make_room(sum(self.numel(k) for k in plan), protect=set(keys))
        for k in plan:
            self.inflight[k] = self._gather(k, tag, id(module))
            self.gathers += 1
        self.peak_live = max(self.peak_live, self.live_numel())

    def release(self, module: nn.Module) -> None:
        """A forward of ``module`` ended: free its buckets unless in use or reused soon."""
        for k in self.units.get(id(module), []):
            self.users[k] = max(0, self.users[k] - 1)
            if self.users[k] == 0 and not self.planner.reused_soon(k):
                self.free(k)

    def enter_tiled(self, module: nn.Module) -> None:
        """A tiled module's forward starts: its weight's calls are computed from tiles until ``exit_tiled``."""
        self.tiles.enter(self.unit_map.tiled[id(module)])

    def exit_tiled(self, module: nn.Module) -> None:
        self.tiles.exit()
        if self.device.type == "cpu" and torch.is_grad_enabled() and self.planner.at_forward_end():
            host_memory.give_back_idle()  # before the loss: [Note: the loss's peak] in host_memory.py
            self.gave_back = True

    def tile_label(self, module: nn.Module) -> int:
        """Label the tile gathers of one call of a tiled module (the divergence check counts it as a fetch)."""
        self.gathers += 1
        return self.divergence.label(id(module), blocking=True)

    def acquire(self, keys: Sequence[BucketKey], label: str) -> None:
        """Gather ``keys`` for temporary full access (GatheredParameters); every rank must call it."""
        with span(lambda: f"ds::gather[{label}]"):
            need = [k for k in keys if not self.live(k) and k not in self.inflight]
            self.names[-1] = label
            tag = self.divergence.label(-1, blocking=True)
            for k in need:  # exact: full access never sees ZeRO++'s quantized or secondary copies
                self.inflight[k] = self._gather(k, tag, -1, exact=True)
            for k in keys:
                handle = self.inflight.pop(k, None)
                if handle is not None:
                    handle.wait()
                self.users[k] += 1

    def hold(self, keys: Sequence[BucketKey], *, in_flight: int) -> None:
        """Gather ``keys`` (``in_flight`` bucket all-gathers at a time) and keep them gathered with the hooks
        suspended until ``unhold`` (see [Note: held buckets]); every rank must call it."""
        keys = [k for k in keys if k not in self.held]
        for start in range(0, len(keys), max(1, in_flight)):
            chunk = keys[start : start + max(1, in_flight)]
            self.gathers += sum(1 for k in chunk if not self.live(k) and k not in self.inflight)
            self.acquire(chunk, "hybrid engine")
            self.held.update(chunk)
        self.peak_live = max(self.peak_live, self.live_numel())
        self.hooks.suspend()

    def unhold(self) -> None:
        """End the hold: the hooks work again and the held buckets are freed."""
        keys, self.held = sorted(self.held), set()
        self.hooks.resume()
        self.release_keys(keys)

    def release_keys(self, keys: Sequence[BucketKey]) -> None:
        for k in keys:
            self.users[k] = max(0, self.users[k] - 1)
            if self.users[k] == 0:
                self.free(k)

    def grads_done(self, key: BucketKey) -> None:
        """Every parameter of ``key`` has its gradient for this backward: no later backward reads it."""
        if key[1] in self.groups[key[0]].persistent:
            return
        self.users[key] = 0
        self.free(key)

    def end_backward(self, *, failed: bool = False) -> None:
        """Backward is over: check that the ranks agree, free every non-persistent bucket, keep the record.
        ``failed``: it raised; free without waiting for the gathers in flight and without the agreement
        check (both would wait for peers that may be gone)."""
        if failed:
            self.inflight.clear()
        else:
            self.check_agreement()
        self.hooks.end_backward()
        for g, gs in enumerate(self.groups):
            for b in range(len(gs.full)):
                self.free((g, b))
        self.users.clear()
        self.deferred.clear()
        if not failed:
            self.planner.finish()

    def free(self, key: BucketKey) -> None:
        if key in self.held:  # see [Note: held buckets]
            return
        handle = self.inflight.pop(key, None)
        if handle is not None:
            handle.wait()
        self.groups[key[0]].free(key[1])

    # ------------------------------------------------------------------ divergence detection (divergence.py)
    def check_agreement(self) -> None:
        self.divergence.check_agreement()

    def _gather(self, key: BucketKey, tag: int, mid: int, *, exact: bool = False) -> _Gather:
        """All-gather one bucket (asynchronously); its failure will name this rank's module and the others'."""
        try:
            handle = self.groups[key[0]].gather(key[1], async_op=True, tag=tag, exact=exact, stream=self.stream)
            return _Gather(self, handle, tag, mid)
        except RuntimeError as err:
            raise self.divergence.gather_failed(err, tag, mid) from err


class _Gather:
    """An in-flight bucket gather whose failure is reported as a ZeRO-3 gather error (see the notes)."""

    __slots__ = ("_gatherer", "_handle", "_mid", "_tag")

    def __init__(self, gatherer: ParamGatherer, handle: Handle, tag: int, mid: int) -> None:
        self._gatherer, self._handle, self._tag, self._mid = gatherer, handle, tag, mid

    def wait(self) -> None:
        try:
            self._handle.wait()
        except RuntimeError as err:
            raise self._gatherer.divergence.gather_failed(err, self._tag, self._mid) from err
