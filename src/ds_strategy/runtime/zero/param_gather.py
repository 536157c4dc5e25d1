"""Stage 3's module hooks: gather a module's parameters before its forward and backward, free them after,
prefetch along the recorded execution order, and detect ranks that gather different modules.

[Note: gather units and hooks]
A module's *unit* is the set of (group, bucket) keys holding its direct, partitioned parameters (buckets
are module-aligned, see stage3.py), plus any registered external parameters (and, for torch modules that
read their children's weights directly, like ``nn.MultiheadAttention``, the whole subtree). A leaf
module's unit is its whole subtree and its descendants have none (see [Note: leaf modules] in leaf.py).
A forward pre-hook gathers the unit and counts a user; the forward hook drops the user and frees the
buckets (unless a later use is near, see below), and registers - on the forward's output tensors - a
multi-grad hook that gathers the unit again when the gradient w.r.t. those outputs is ready, i.e. just
before the module's backward.
In backward a bucket is freed as soon as all of its parameters' gradients have been accumulated (the
post-accumulate-grad hook that also feeds the reduce-scatter), which is also after the last use of a
tied or reused parameter; ``end_backward`` frees whatever is left. Persistent buckets are never freed.

[Note: prefetch order]
The first iteration (root forward through ``end_backward``) records the sequence of unit fetches. Later
iterations follow it with a cursor: after fetching a unit, the buckets of the next units in the record
are all-gathered asynchronously until ``stage3_prefetch_bucket_size`` elements are in flight, without
exceeding ``stage3_max_live_parameters`` live elements (buckets with no user are freed first to make
room). When a unit's users drop to 0 it stays gathered if the record says it is used again within
``stage3_max_reuse_distance`` gathered elements. If execution leaves the recorded path the cursor is
dropped: no prefetch or reuse until the next iteration. All of this depends only on what every rank
executes, so all ranks issue the same collectives in the same order.

[Note: reshard after use]
DeepSpeed's defaults (``stage3_max_reuse_distance`` = ``stage3_max_live_parameters`` = 1e9) keep every unit
of a model below 1e9 parameters gathered from its forward to its backward, and its prefetch default
(``stage3_prefetch_bucket_size`` = 5e7) gathers up to 50M elements ahead: stage 3 then holds most of a
small model, as stage 2 does. So when the config does not state ``stage3_max_reuse_distance``, a unit is
freed after use unless one of the next ``REUSE_UNITS`` distinct units of the recorded order uses it again
(the last block of the forward, whose backward comes next; the rest unit between the root's forward and
its backward), and when it does not state ``stage3_prefetch_bucket_size`` only the next unit is prefetched:
FSDP2's reshard-after-forward and its one-block prefetch. A config that states the keys keeps DeepSpeed's
meaning.

[Note: frozen buckets in backward]
Buckets of frozen parameters (see [Note: frozen parameters] in stage3.py) get no gradient, so no
post-accumulate-grad hook frees them. Backward still needs them (the gradient w.r.t. a frozen Linear's
input reads its weight), so they are gathered before the module's backward like the others, and freed
by a multi-grad hook on the module's *inputs*: once the gradients w.r.t. every input that requires one
are computed, the module's backward is over. A module whose inputs need no gradient (the first layer)
keeps its frozen buckets until ``end_backward``, which frees everything.

[Note: held buckets]
The hybrid engine's generate (runtime/hybrid.py) gathers every partitioned bucket once, ``in_flight``
buckets in flight at a time, and *holds* them: while anything is held the module hooks are removed (no
gather, no release, no divergence label: ranks may run different numbers of forwards, so generation
needs no ``synced_gpus``; removed rather than made to return early, because a module with no hooks takes
torch's fast call path: hooks that only return cost a 64-token generation ~15% on a GPU, where each
decoding step is launch-bound), and ``_free`` leaves held buckets alone, so a training forward and backward
under a pinned hold (``pin_parameters``) read the held copy and its post-accumulate-grad frees are moot.
``unhold`` ends it (after generate, or before the optimizer step updates the partitions the held copy
was gathered from), puts the hooks back if they were attached, and frees the buckets.

[Note: compiled regions]
Under ``compile`` (runtime/compile.py) stage 3 compiles each repeated block's forward and marks the block
a leaf: its unit is its whole subtree, gathered by the block's own hooks, which run eagerly around the
compiled forward. Its descendants have no unit, so their hooks would do nothing, but inside a compiled
forward dynamo would trace them and guard on each module's identity (one recompile per block). So the
modules inside a compiled region get no hooks at all (``unhook_inside``): nothing inside a graph gathers,
releases or communicates, and one graph serves every block.

Divergence detection (ranks running different modules) lives in divergence.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from ds_strategy import env
from ds_strategy.accelerator.spans import span

from .base import BucketKey
from .collectives import Collectives, Handle
from .divergence import DivergenceCheck
from .leaf import leaf_generation
from .sharded import ShardedGroup
from .streams import GatherStream
from .units import MODULES, FetchUnitPolicy, unit_owners

EXTERNAL_ATTR = "_ds_external_params"
# torch modules whose forward reads their children's parameters without calling the children
# (MultiheadAttention passes ``out_proj.weight`` to the functional attention): their unit is the subtree.
READS_CHILD_PARAMETERS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
TIMEOUT_ENV = env.GATHER_TIMEOUT
REUSE_UNITS = 2  # [Note: reshard after use]: kept when one of the next this many units uses it again


class ParamGatherer:
    """Gathers and frees stage 3's buckets around module forwards and backwards (see the notes)."""

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
    ) -> None:
        self.policy = policy
        self.groups = groups
        self.root = root
        self.coll = coll
        # The headers travel where the gathered buckets do: the compute device (NCCL takes nothing else).
        self.device = next((gs.device for gs in groups if gs.full), torch.device("cpu"))
        self.stream = GatherStream(self.device)  # [Note: gather stream] in streams.py
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.reuse_distance = reuse_distance
        configured = env.get(TIMEOUT_ENV)
        self.timeout_s = float(configured) if configured else timeout_s
        self.bucket_of: dict[int, BucketKey] = {}
        for g, gs in enumerate(groups):
            for i, p in enumerate(gs.params):
                b = gs.slot(i).bucket
                if b not in gs.persistent:
                    self.bucket_of[id(p)] = (g, b)
        self.names: dict[int, str] = {}
        self.index: dict[int, int] = {}
        for n, (name, m) in enumerate(root.named_modules()):
            self.names[id(m)] = name or "<root>"
            self.index[id(m)] = n
        self.units: dict[int, list[BucketKey]] = {}
        self.frozen_units: dict[int, list[BucketKey]] = {}
        self._leaf_generation = -1
        self._compute_units()
        probe = next((gs.full[0] for gs in groups if gs.full), None)  # what a bucket gather looks like
        self.divergence = DivergenceCheck(coll, self.device, probe, self.names, self.index, self.timeout_s)
        self.users: dict[BucketKey, int] = defaultdict(int)
        self.inflight: dict[BucketKey, _Gather] = {}
        self.trace: list[int] | None = None
        self._recording: list[int] | None = None
        self._cursor: int | None = None
        self._hooks: list[RemovableHandle] = []  # the root's
        self._module_hooks: list[RemovableHandle] = []  # the other unit modules'
        self.unhooked: set[int] = set()  # modules inside compiled regions: see [Note: compiled regions]
        self.held: set[BucketKey] = set()  # see [Note: held buckets]
        self.suspended = False
        self._reattach = False  # unhold puts the hooks back (they were attached when the hold began)
        self.gathers = 0  # bucket all-gathers issued (for tests and reports) ...
        self.misses = 0  # ... fetches that found a bucket neither gathered nor prefetched ...
        self.peak_live = 0  # ... and the most partitioned-bucket elements gathered at once

    # ------------------------------------------------------------------ set-up
    def keys_of(self, params: Iterable[torch.Tensor | None]) -> list[BucketKey]:
        return sorted({self.bucket_of[id(p)] for p in params if p is not None and id(p) in self.bucket_of})

    def _compute_units(self) -> None:
        """Every module's unit (see [Note: gather units and hooks] and [Note: fetch units] in units.py): a
        unit module's is its whole subtree, the modules inside it have none; a leaf module is a unit under
        every policy. Externals registered on a module inside a unit join that unit. The modules owning
        parameters of the rest unit directly fetch it too (calls outside the root's forward)."""
        self._leaf_generation = leaf_generation()
        sizes = {id(p): s.numel for gs in self.groups for p, s in zip(gs.params, gs.layout.params, strict=True)}
        owners = unit_owners(self.root, self.policy, lambda p: sizes.get(id(p), p.numel()))
        params: dict[int, list[torch.Tensor | None]] = defaultdict(list)
        holders: list[nn.Module] = []
        for m in self.root.modules():
            owner = owners[id(m)]
            direct = list(m._parameters.values()) + list(getattr(m, EXTERNAL_ATTR, []))
            params[id(owner)] += direct
            if owner is m and isinstance(m, READS_CHILD_PARAMETERS):
                params[id(m)] += list(m.parameters())
            if owner is self.root and m is not self.root and self.keys_of(direct):
                holders.append(m)
        self.units = {id(m): self.keys_of(params.get(id(m), [])) for m in self.root.modules()}
        for m in holders:
            self.units[id(m)] = self.units[id(self.root)]
        self.frozen_units = {
            mid: frozen for mid, keys in self.units.items() if (frozen := [k for k in keys if self.groups[k[0]].frozen])
        }

    def add_external(self, module: nn.Module, param: torch.Tensor) -> None:
        """Gather ``param`` whenever ``module`` runs (``register_external_parameter``, which has recorded it on
        ``module`` already)."""
        self._compute_units()
        if self._module_hooks:  # ``module`` may have had no unit, hence no hooks, until now
            self._unhook_modules()
            self._hook_modules()

    def _follow_leaf_changes(self) -> None:
        """Leaf flags changed since the units were computed (see [Note: leaf modules]): recompute them between
        iterations, and record a new prefetch trace if any unit changed."""
        before = self.units
        self._compute_units()
        if self.units != before:
            self.trace = None
            self._recording = None
            self._cursor = None
            if self._hooks:  # other modules may be units now (the root's own hooks are running: kept)
                self._unhook_modules()
                self._hook_modules()

    def attach(self) -> None:
        if self.suspended:  # during a hold: attached when it ends (see [Note: held buckets])
            self._reattach = True
            return
        root = self.root
        self._hooks.append(root.register_forward_pre_hook(self._on_root_start))
        self._hooks.append(root.register_forward_pre_hook(self._pre_forward))
        self._hooks.append(root.register_forward_hook(self._post_forward, with_kwargs=True))
        self._hooks.append(root.register_forward_hook(self._on_root_end))
        self._hook_modules()

    def _hook_modules(self) -> None:
        """Hooks on the modules with a unit only: the modules inside a unit take torch's fast call path."""
        for m in self.root.modules():
            if m is self.root or id(m) in self.unhooked or not self.units.get(id(m)):
                continue
            self._module_hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._module_hooks.append(m.register_forward_hook(self._post_forward, with_kwargs=True))

    def _unhook_modules(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()

    def unhook_inside(self, regions: Iterable[nn.Module]) -> None:
        """Hook no module strictly inside ``regions``, leaf modules compiled as a whole (see [Note: compiled
        regions]); takes effect now if attached."""
        self.unhooked |= {id(m) for region in regions for m in region.modules() if m is not region}
        if self._hooks:
            self.detach()
            self.attach()

    def detach(self) -> None:
        self._reattach = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._unhook_modules()

    def _numel(self, key: BucketKey) -> int:
        return self.groups[key[0]].full[key[1]].numel()

    def _live(self, key: BucketKey) -> bool:
        return self.groups[key[0]].live[key[1]]

    def live_numel(self) -> int:
        return sum(gs.live_numel() for gs in self.groups)

    # ------------------------------------------------------------------ hooks
    def _on_root_start(self, module: nn.Module, args: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        if self._leaf_generation != leaf_generation():
            self._follow_leaf_changes()
        if self.trace is None:
            self._recording = []
        self._cursor = 0
        for key in [k for k, n in self.users.items() if n <= 0]:
            self._free(key)

    def _on_root_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        if not torch.is_grad_enabled():  # no backward follows: nothing stays gathered for it
            self.check_agreement()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        self.fetch(module)

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        if not self.units.get(id(module)):
            return
        if torch.is_grad_enabled():
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                register_multi_grad_hook(outs, lambda grads, m=module: self.fetch(m), mode="any")
                frozen = self.frozen_units.get(id(module))
                ins = [t for t in _tensors((args, kwargs)) if t.requires_grad] if frozen else []
                if ins:  # see [Note: frozen buckets in backward]
                    register_multi_grad_hook(ins, lambda grads, k=frozen: self.release_keys(k), mode="all")
        self.release(module)

    # ------------------------------------------------------------------ gather / release
    def fetch(self, module: nn.Module) -> None:
        """Gather ``module``'s unit (and prefetch the next ones); count a user of each of its buckets."""
        keys = self.units.get(id(module))
        if not keys:
            return
        with span(lambda: f"ds::gather[{self.names.get(id(module), '?')}]"):
            self._fetch(module, keys)

    def _fetch(self, module: nn.Module, keys: list[BucketKey]) -> None:
        self._advance(id(module))
        need = [k for k in keys if not self._live(k) and k not in self.inflight]
        plan = self._prefetch_plan(set(keys), sum(self._numel(k) for k in need))
        if need or plan:
            self._make_room(sum(self._numel(k) for k in need + plan), protect=set(keys))
        tag = self._label(id(module), blocking=bool(need))
        for k in need + plan:
            self.inflight[k] = self._gather(k, tag, id(module))
            self.gathers += 1
        self.misses += bool(need)
        self.peak_live = max(self.peak_live, self.live_numel())
        for k in keys:
            handle = self.inflight.pop(k, None)
            if handle is not None:
                handle.wait()
            self.users[k] += 1

    def release(self, module: nn.Module) -> None:
        """A forward of ``module`` ended: free its buckets unless in use or reused soon."""
        for k in self.units.get(id(module), []):
            self.users[k] = max(0, self.users[k] - 1)
            if self.users[k] == 0 and not self._reused_soon(k):
                self._free(k)

    def acquire(self, keys: Sequence[BucketKey], label: str) -> None:
        """Gather ``keys`` for temporary full access (GatheredParameters); every rank must call it."""
        with span(lambda: f"ds::gather[{label}]"):
            self._acquire(keys, label)

    def _acquire(self, keys: Sequence[BucketKey], label: str) -> None:
        need = [k for k in keys if not self._live(k) and k not in self.inflight]
        self.names[-1] = label
        tag = self._label(-1, blocking=True)
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
            self.gathers += sum(1 for k in chunk if not self._live(k) and k not in self.inflight)
            self.acquire(chunk, "hybrid engine")
            self.held.update(chunk)
        self.peak_live = max(self.peak_live, self.live_numel())
        if not self.suspended:
            attached = bool(self._hooks)
            self.detach()
            self._reattach = attached
        self.suspended = True

    def unhold(self) -> None:
        """End the hold: the hooks work again and the held buckets are freed."""
        keys, self.held = sorted(self.held), set()
        self.suspended = False
        if self._reattach:
            self._reattach = False
            self.attach()
        self.release_keys(keys)

    def release_keys(self, keys: Sequence[BucketKey]) -> None:
        for k in keys:
            self.users[k] = max(0, self.users[k] - 1)
            if self.users[k] == 0:
                self._free(k)

    def grads_done(self, key: BucketKey) -> None:
        """Every parameter of ``key`` has its gradient for this backward: no later backward reads it."""
        if key[1] in self.groups[key[0]].persistent:
            return
        self.users[key] = 0
        self._free(key)

    def end_backward(self) -> None:
        """Backward is over: check that the ranks agree, free every non-persistent bucket, keep the record."""
        self.check_agreement()
        for g, gs in enumerate(self.groups):
            for b in range(len(gs.full)):
                self._free((g, b))
        self.users.clear()
        if self.trace is None and self._recording:
            self.trace = self._recording
        self._recording = None
        self._cursor = None

    def free_all(self) -> None:
        for g, gs in enumerate(self.groups):
            for b in range(len(gs.full)):
                self._free((g, b))
        self.users.clear()

    def _free(self, key: BucketKey) -> None:
        if key in self.held:  # see [Note: held buckets]
            return
        handle = self.inflight.pop(key, None)
        if handle is not None:
            handle.wait()
        self.groups[key[0]].free(key[1])

    # ------------------------------------------------------------------ prefetch / reuse / limits
    def _advance(self, mid: int) -> None:
        if self._recording is not None:
            self._recording.append(mid)
        if self.trace is None or self._cursor is None:
            return
        if self._cursor < len(self.trace) and self.trace[self._cursor] == mid:
            self._cursor += 1
        else:
            self._cursor = None  # off the recorded path (see [Note: prefetch order])

    def _upcoming(self) -> Iterator[int]:
        if self.trace is None or self._cursor is None:
            return iter(())
        return iter(self.trace[self._cursor :])

    def _prefetch_plan(self, exclude: set[BucketKey], needed: int) -> list[BucketKey]:
        """The buckets of the next units to gather now, within ``stage3_max_live_parameters``: the whole next
        unit, then more up to ``stage3_prefetch_bucket_size`` elements when the config states it (HF's "auto"
        size, 0.9 x hidden^2, is a fraction of a transformer block: a block unit would never be prefetched);
        none when it states 0. Not stated: the next unit only ([Note: reshard after use]: DeepSpeed's 5e7
        would keep most of a small model gathered ahead of use)."""
        plan: list[BucketKey] = []
        total = 0
        budget = self.max_live_numel - self.live_numel() - needed
        if self.prefetch_numel is None:
            return self._next_unit(exclude, budget)
        if self.prefetch_numel <= 0:
            return plan
        ahead = self.prefetch_numel
        first: int | None = None  # the first upcoming unit with something to gather
        for mid in self._upcoming():
            for k in self.units.get(mid, []):
                if k in exclude or k in plan or self._live(k) or k in self.inflight:
                    continue
                first = mid if first is None else first
                n = self._numel(k)
                limit = budget if mid == first else min(ahead, budget)
                if total + n > limit:
                    return plan
                plan.append(k)
                total += n
        return plan

    def _next_unit(self, exclude: set[BucketKey], budget: int) -> list[BucketKey]:
        """What the next distinct unit of the recorded order still needs gathered (nothing when it does not
        fit ``budget``): one unit ahead, as FSDP2 prefetches, whether or not it is gathered already."""
        for keys in self._upcoming_units():
            if set(keys) <= exclude:
                continue
            plan = [k for k in keys if k not in exclude and not self._live(k) and k not in self.inflight]
            return plan if sum(self._numel(k) for k in plan) <= budget else []
        return []

    def _upcoming_units(self) -> Iterator[list[BucketKey]]:
        """The units of the recorded order from the cursor on, each once, skipping modules with none."""
        seen: list[list[BucketKey]] = []
        for mid in self._upcoming():
            keys = self.units.get(mid, [])
            if keys and keys not in seen:
                seen.append(keys)
                yield keys

    def _reused_soon(self, key: BucketKey) -> bool:
        if self.reuse_distance is None:  # [Note: reshard after use]
            return self._in_next_units(key, REUSE_UNITS)
        distance = 0
        for mid in self._upcoming():
            keys = self.units.get(mid, [])
            if key in keys:
                return True
            distance += sum(self._numel(k) for k in keys if not self._live(k))
            if distance > self.reuse_distance:
                return False
        return False

    def _in_next_units(self, key: BucketKey, count: int) -> bool:
        """Whether ``key`` belongs to one of the next ``count`` distinct units of the recorded order."""
        return any(key in keys for keys in islice(self._upcoming_units(), count))

    def _make_room(self, extra: int, protect: set[BucketKey]) -> None:
        """Free unused live buckets (oldest key first) until ``extra`` more elements fit the live limit."""
        live = self.live_numel()
        if live + extra <= self.max_live_numel:
            return
        for g, gs in enumerate(self.groups):
            for b, is_live in enumerate(gs.live):
                key = (g, b)
                if is_live and b not in gs.persistent and key not in protect and self.users[key] == 0:
                    live -= self._numel(key)
                    self._free(key)
                    if live + extra <= self.max_live_numel:
                        return

    # ------------------------------------------------------------------ divergence detection (divergence.py)
    def _label(self, mid: int, *, blocking: bool) -> int:
        return self.divergence.label(mid, blocking=blocking)

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


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
