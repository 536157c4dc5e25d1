"""Stage 3's prefetch planner: records the order of unit fetches, follows it, and decides from it which
buckets to gather ahead, which to keep gathered after use, and which to free to stay within the live limit.

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
freed after use unless one of the next ``REUSE_UNITS`` unit fetches of the recorded order uses it again
(the last block of the forward, whose backward comes next; the rest unit between the root's forward and
its backward), and when it does not state ``stage3_prefetch_bucket_size`` only the next unit is prefetched:
FSDP2's reshard-after-forward and its one-block prefetch. A config that states the keys keeps DeepSpeed's
meaning.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence
from itertools import islice
from typing import Protocol

from ..layout import BucketKey
from .sharded import ShardedGroup

REUSE_UNITS = 2  # [Note: reshard after use]: kept when one of the next this many units uses it again


class GatheredBuckets(Protocol):
    """What the planner reads and frees of the gathered buckets (``ParamGatherer`` in param_gather.py)."""

    @property
    def groups(self) -> Sequence[ShardedGroup]: ...

    @property
    def inflight(self) -> Container[BucketKey]: ...

    @property
    def users(self) -> Mapping[BucketKey, int]: ...

    def live(self, key: BucketKey) -> bool: ...

    def numel(self, key: BucketKey) -> int: ...

    def live_numel(self) -> int: ...

    def free(self, key: BucketKey) -> None: ...


class PrefetchPlanner:
    """The recorded order of unit fetches and the cursor that follows it (see [Note: prefetch order]), and the
    prefetch, reuse and live-limit decisions taken from it. ``units`` is the ``UnitMap``'s (unit_map.py)."""

    def __init__(
        self,
        units: Mapping[int, list[BucketKey]],
        buckets: GatheredBuckets,
        *,
        prefetch_numel: int | None,
        max_live_numel: int,
        reuse_distance: int | None,
    ) -> None:
        self.units, self.buckets = units, buckets
        self.prefetch_numel, self.max_live_numel, self.reuse_distance = prefetch_numel, max_live_numel, reuse_distance
        self.trace: list[int] | None = None  # the recorded order: the fetched modules' ids
        self._recording: list[int] | None = None
        self._cursor: int | None = None

    # ------------------------------------------------------------------ the record and its cursor
    def begin(self) -> None:
        """A root forward starts: record the fetches if there is no record yet; follow it from its start."""
        if self.trace is None:
            self._recording = []
        self._cursor = 0

    def finish(self) -> None:
        """Backward is over: the first iteration's recording becomes the record."""
        if self.trace is None and self._recording:
            self.trace = self._recording
        self._recording = None
        self._cursor = None

    def forget(self) -> None:
        """The units changed: drop the record, the next iteration records a new one."""
        self.trace = None
        self._recording = None
        self._cursor = None

    def advance(self, mid: int) -> None:
        """Module ``mid`` fetches its unit: record it, or move the cursor past it."""
        if self._recording is not None:
            self._recording.append(mid)
        if self.trace is None or self._cursor is None:
            return
        if self._cursor < len(self.trace) and self.trace[self._cursor] == mid:
            self._cursor += 1
        else:
            self._cursor = None  # off the recorded path (see [Note: prefetch order])

    def at_forward_end(self) -> bool:
        """Whether the record's next fetch is the one made last: the last block's forward is done and its
        backward comes next, so no stage-3 work remains in this forward."""
        at = self._cursor
        return (
            self.trace is not None
            and at is not None
            and 0 < at < len(self.trace)
            and self.trace[at] == self.trace[at - 1]
        )

    def _upcoming(self) -> Iterator[int]:
        if self.trace is None or self._cursor is None:
            return iter(())
        return iter(self.trace[self._cursor :])

    # ------------------------------------------------------------------ prefetch / reuse / limits
    def plan(self, exclude: set[BucketKey], needed: int) -> list[BucketKey]:
        """The buckets of the next units to gather now, within ``stage3_max_live_parameters``: the whole next
        unit, then more up to ``stage3_prefetch_bucket_size`` elements when the config states it (HF's "auto"
        size, 0.9 x hidden^2, is a fraction of a transformer block: a block unit would never be prefetched);
        none when it states 0. Not stated: the next unit only ([Note: reshard after use]: DeepSpeed's 5e7
        would keep most of a small model gathered ahead of use)."""
        buckets = self.buckets
        plan: list[BucketKey] = []
        total = 0
        budget = self.max_live_numel - buckets.live_numel() - needed
        if self.prefetch_numel is None:
            return self._next_unit(exclude, budget)
        if self.prefetch_numel <= 0:
            return plan
        ahead = self.prefetch_numel
        first: int | None = None  # the first upcoming unit with something to gather
        for mid in self._upcoming():
            for k in self.units.get(mid, []):
                if k in exclude or k in plan or buckets.live(k) or k in buckets.inflight:
                    continue
                first = mid if first is None else first
                n = buckets.numel(k)
                limit = budget if mid == first else min(ahead, budget)
                if total + n > limit:
                    return plan
                plan.append(k)
                total += n
        return plan

    def _next_unit(self, exclude: set[BucketKey], budget: int) -> list[BucketKey]:
        """What the next distinct unit of the recorded order still needs gathered (nothing when it does not
        fit ``budget``): one unit ahead, as FSDP2 prefetches, whether or not it is gathered already. When the
        next unit is the one being fetched (the last block of the forward, whose backward comes next), nothing
        is gathered now: the unit after it is prefetched when that backward starts, not across the head and
        the loss, where it would only add a unit to the step's peak."""
        buckets = self.buckets
        for keys in self._upcoming_units():
            plan = [k for k in keys if k not in exclude and not buckets.live(k) and k not in buckets.inflight]
            return plan if sum(buckets.numel(k) for k in plan) <= budget else []
        return []

    def _upcoming_units(self) -> Iterator[list[BucketKey]]:
        """The units of the recorded order from the cursor on, each once, skipping modules with none."""
        seen: list[list[BucketKey]] = []
        for mid in self._upcoming():
            keys = self.units.get(mid, [])
            if keys and keys not in seen:
                seen.append(keys)
                yield keys

    def reused_soon(self, key: BucketKey) -> bool:
        """Whether the record says ``key`` is used again soon enough to stay gathered after use."""
        if self.reuse_distance is None:  # [Note: reshard after use]
            return self._in_next_units(key, REUSE_UNITS)
        buckets = self.buckets
        distance = 0
        for mid in self._upcoming():
            keys = self.units.get(mid, [])
            if key in keys:
                return True
            distance += sum(buckets.numel(k) for k in keys if not buckets.live(k))
            if distance > self.reuse_distance:
                return False
        return False

    def _in_next_units(self, key: BucketKey, count: int) -> bool:
        """Whether one of the next ``count`` unit fetches of the recorded order (modules with no unit skipped)
        uses ``key``: fetches, not distinct units, so a block whose backward follows the last block's is
        not kept across the head and the loss (the last block's own backward counts as one fetch)."""
        fetches = (keys for keys in (self.units.get(mid, []) for mid in self._upcoming()) if keys)
        return any(key in keys for keys in islice(fetches, count))

    def make_room(self, extra: int, protect: set[BucketKey]) -> None:
        """Free unused live buckets (oldest key first) until ``extra`` more elements fit the live limit."""
        buckets = self.buckets
        live = buckets.live_numel()
        if live + extra <= self.max_live_numel:
            return
        users = buckets.users
        for g, gs in enumerate(buckets.groups):
            for b, is_live in enumerate(gs.live):
                key = (g, b)
                if is_live and b not in gs.persistent and key not in protect and users[key] == 0:
                    live -= buckets.numel(key)
                    buckets.free(key)
                    if live + extra <= self.max_live_numel:
                        return
