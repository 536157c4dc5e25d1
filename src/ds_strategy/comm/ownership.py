"""The package owns the process groups and communicators it creates, and releases exactly those.

    groups = GroupSet(self, attributes=("ep_group", "edp_group"))   # in the owner's constructor
    pg = groups.new_group(ranks)                                     # dist.new_group, recorded
    ...
    groups.destroy()                                                 # in the owner's close()/destroy()

[Note: clean exits by ownership]
Why anything happens at exit at all: gloo joins a group's worker threads (``pt_gloo_runloop``,
``gloo_tcp_loop``) only when the last reference to the group dies; ``destroy_process_group()`` unregisters
it and leaves the threads running. A group still referenced at interpreter exit takes its threads into
finalisation, where a thread that asks for the GIL (dropping the last reference to a Python-owned tensor of
a finished collective, as happens when the peer is still working) is ended by CPython with a forced unwind
that aborts: "terminate called without an active exception", SIGABRT, a failed rank after a successful run
(pytorch/pytorch#190489: torch asks every script to call ``destroy_process_group()`` before exit). Measured
here: 2 of 12 launches of shared/repro/exit_abort.py before any exit handling.

What the package does about it, by ownership (issue 43; the earlier handler walked the heap and set every
reference to a destroyed group to None, users' objects included):

- A group the package creates is recorded by the object that created it: ``init_distributed`` for the
  default group it initialises (a weak reference: the record keeps nothing alive), and a ``GroupSet`` for
  the subgroups of an owner (MoE expert groups, pipeline stage and tie groups, ZeRO++ node groups, the
  tensor-parallel generation group). The owner's ``close()``/``destroy()`` calls ``GroupSet.destroy()``:
  the groups are destroyed (a local call), the owner's declared attributes that hold them become None, and
  every ``Communicator`` built on them drops its reference (``Communicator.release``). The owner holds no
  other reference, so the groups die there and gloo joins their threads.
- At a normal exit one ``atexit`` handler (registered when the package creates its first group, so the
  script's own handlers registered later still find the groups alive) does the same for what is still
  alive: every live ``GroupSet`` is destroyed, then the default group if the package created it. No heap
  walk: the records are the package's own, so the handler's cost does not grow with the heap.
- A group the package did not create (the script's ``init_process_group``, its ``new_group``s, a Lightning
  or FSDP2 mesh) is never destroyed or touched, at exit or ever. Destroying the default group would
  destroy every group registered over it (torch's ``destroy_process_group()`` takes them all), so when
  groups the package did not create are still registered at exit, the package leaves its default group
  too and says so (a warning naming them). Destroying them is the script's job, as torch documents.
- The package's communicators on a group someone else destroyed (a script's ``destroy_process_group()``
  at its end) drop their reference at exit, so that the package is never the holder that keeps a
  destroyed group's threads alive.
- torch itself: ``torch.distributed.nn.functional`` takes ``group=group.WORLD`` as default argument
  values, evaluated when the module is imported; ``torch.optim`` imports it lazily (through
  ``torch._dynamo``), usually after the default group exists, and then holds that group for ever. The
  package imports the module before it creates a default group (its defaults are then None, the default
  group in every torch.distributed signature), and at exit releases exactly that holder: a default value
  of that module's functions that is a group no longer registered (destroyed, so unusable) becomes None.
  Nothing else of torch's is touched.

A rank that failed (an uncaught exception) skips all of it and does not wait for its peers: a peer may
still be inside a collective, where tearing down could block. See docs/architecture.md, "Clean exits".
"""

from __future__ import annotations

import atexit
import datetime
import logging
import sys
import time
import types
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch.distributed as dist

from ds_strategy import env
from ds_strategy.comm.fake import is_fake_group


class Communicator(Protocol):
    """What ownership needs of a ``comm.collectives.Communicator``: its group, and to let go of it."""

    group: Any

    def release(self) -> None: ...


log = logging.getLogger(__name__)

EXIT_WAIT_ENV = env.EXIT_WAIT
TORCH_HOLDER = "torch.distributed.nn.functional"  # the one torch module holding groups as default values


class _Records:
    """What this process's package objects created and still own (one per process: groups are per process)."""

    def __init__(self) -> None:
        self.default_group: weakref.ref[Any] | None = None  # the default group init_distributed created
        self.group_sets: list[weakref.ref[GroupSet]] = []  # creation order; dead entries pruned on add
        self.communicators: weakref.WeakSet[Communicator] = weakref.WeakSet()
        self.subgroup_names: set[str] = set()  # names of the subgroups GroupSets created (names: no references)
        self.registered = False
        self.last_exit_seconds: float | None = None  # how long the last exit handler ran (tests, benchmarks)


_records = _Records()


# ---- recording -----------------------------------------------------------------------------------------


def created_default_group() -> None:
    """Record that the package (``init_distributed``) created the current default group; register the exit
    handler. A weak reference: the record keeps nothing alive."""
    if not dist.is_initialized():  # nothing was created after all
        return
    group = dist.distributed_c10d._get_default_group()
    _records.default_group = weakref.ref(group)
    _register_exit_handler()


def owns_default_group() -> bool:
    """Whether the current default group is the one the package created."""
    ref = _records.default_group
    return (
        ref is not None
        and dist.is_initialized()
        and ref() is not None
        and ref() is dist.distributed_c10d._get_default_group()
    )


def track_communicator(comm: Communicator) -> None:
    """Remember a live communicator (weakly), so that its owner's groups can be released from it; register
    the exit handler (which releases the communicators on groups destroyed by then)."""
    _records.communicators.add(comm)
    _register_exit_handler()


def release_communicators(groups: Iterable[Any]) -> int:
    """``release()`` every live package communicator built on one of ``groups``; how many."""
    ids = {id(g) for g in groups if g is not None}
    released = 0
    for comm in list(_records.communicators):
        if comm.group is not None and id(comm.group) in ids:
            comm.release()
            released += 1
    return released


def prepare_torch_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` before the package creates a default group, so that its
    ``group=group.WORLD`` default values are None rather than the group (see [Note: clean exits by
    ownership])."""
    if not dist.is_initialized():
        __import__(TORCH_HOLDER)


class GroupSet:
    """The process groups one object created (its expert, stage, tie or node groups).

    ``owner``: the creating object (held weakly; ``bind`` names it later). ``attributes``: the owner's
    attributes that hold the groups (a group, or a dict / list of them, one level of nesting deep);
    ``destroy()`` sets what holds a group there to None, and releases the communicators built on the
    groups. ``destroy()`` is idempotent, local (not a collective) and runs at a normal exit for every set
    still alive.
    """

    def __init__(self, owner: object | None = None, *, attributes: tuple[str, ...] = ()) -> None:
        self._owner: weakref.ref[Any] | None = None
        self._attributes = attributes
        self._groups: list[Any] = []
        self.what = "?"
        if owner is not None:
            self.bind(owner)
        _records.group_sets = [r for r in _records.group_sets if r() is not None]
        _records.group_sets.append(weakref.ref(self))
        _register_exit_handler()

    def bind(self, owner: object) -> None:
        """Name the owner when it is built after its groups (a classmethod that creates them first)."""
        self._owner = weakref.ref(owner)
        self.what = type(owner).__qualname__

    def new_group(self, ranks: list[int] | None = None, **kwargs: Any) -> Any:
        """``torch.distributed.new_group(ranks, **kwargs)`` (a collective over the default group), recorded
        when this rank is a member (a non-member gets torch's placeholder, which owns nothing)."""
        group = dist.new_group(ranks, **kwargs)
        if isinstance(group, dist.ProcessGroup):
            self._groups.append(group)
            _records.subgroup_names.add(group.group_name)
        return group

    def partition(self, rank_sets: list[list[int]], **kwargs: Any) -> tuple[Any, list[int]]:
        """A group for every set of ``rank_sets`` (disjoint sets covering the ranks), created on every rank in
        this order (``new_group`` is a collective over the default group); returns this rank's group and its
        ranks, or ``(None, [])`` when this rank is in none of the sets."""
        me, mine, ranks_of_mine = dist.get_rank(), None, []
        for ranks in rank_sets:
            group = self.new_group(ranks, **kwargs)
            if me in ranks:
                mine, ranks_of_mine = group, ranks
        return mine, ranks_of_mine

    def __contains__(self, group: object) -> bool:
        return any(g is group for g in self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def destroy(self) -> None:
        """Destroy the groups, drop the owner's declared references and the communicators' (see the class)."""
        groups, self._groups = self._groups, []
        if not groups:
            return
        release_communicators(groups)
        owner = None if self._owner is None else self._owner()
        if owner is not None:
            ids = {id(g) for g in groups}
            for name in self._attributes:
                value = getattr(owner, name, None)
                if id(value) in ids:
                    setattr(owner, name, None)
                else:
                    _clear_in(value, ids, depth=2)
        registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
        for group in reversed(groups):
            if group in registered:
                try:
                    dist.destroy_process_group(group)
                except Exception as err:  # report, never raise from a teardown
                    log.debug("%s: destroying a process group failed: %s", self.what, err)
        groups.clear()


def _clear_in(value: object, ids: set[int], depth: int) -> None:
    """Set the groups in ``ids`` to None inside a dict or list the owner holds (``depth`` levels)."""
    if depth == 0:
        return
    if isinstance(value, dict):
        for key, item in list(value.items()):
            if id(item) in ids:
                value[key] = None
            else:
                _clear_in(item, ids, depth - 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if id(item) in ids:
                value[i] = None
            else:
                _clear_in(item, ids, depth - 1)


# ---- the exit handler ------------------------------------------------------------------------------------


def _register_exit_handler() -> None:
    if _records.registered:
        return
    _records.registered = True
    atexit.register(_at_exit)


def _exiting_after_uncaught_exception() -> bool:
    # The interpreter keeps an uncaught exception in sys.last_value (and sys.last_exc from 3.12) before it
    # runs the atexit handlers: no sys.excepthook wrapper needed, which would outlive the group it served.
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _at_exit() -> None:
    if _exiting_after_uncaught_exception():  # a failed rank: no teardown, no waiting for peers
        return
    start = time.perf_counter()
    try:
        release_owned(meet_peers=True)
    except Exception as err:  # at exit: report, never raise
        log.debug("exit: releasing the package's process groups failed: %s", err)
    _records.last_exit_seconds = time.perf_counter() - start


def release_owned(*, meet_peers: bool = False) -> None:
    """What the exit handler does (also callable directly, e.g. by a test): destroy every live
    ``GroupSet``, then the default group if the package created it and nothing else still needs it; release
    the package's communicators on destroyed groups and torch's default-argument holder."""
    ours = owns_default_group()
    if ours and meet_peers:
        _meet_peers_before_teardown()
    for ref in reversed(_records.group_sets):
        group_set = ref()
        if group_set is not None:
            group_set.destroy()
    _records.group_sets = []
    _destroy_orphans()
    if ours:
        others = _groups_not_ours()
        if others:
            log.warning(
                "exit: process group(s) %s that ds_strategy did not create are still registered; ds_strategy "
                "leaves them and its default group alone (destroying the default group would destroy them): "
                "call torch.distributed.destroy_process_group() on them before exit (pytorch/pytorch#190489)",
                ", ".join(others),
            )
        else:
            try:
                dist.destroy_process_group()
            except Exception as err:
                log.debug("exit: destroying the default process group failed: %s", err)
    _records.default_group = None
    registered = dist.distributed_c10d._world.pg_map
    destroyed = [c.group for c in list(_records.communicators) if c.group is not None and c.group not in registered]
    release_communicators(destroyed)
    release_torch_defaults()


def _destroy_orphans() -> None:
    """Destroy the package's subgroups whose owner was dropped without ``close()``: torch's registry is then
    their only holder (found by name: the records hold no reference)."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group.group_name in _records.subgroup_names:
            try:
                dist.destroy_process_group(group)
            except Exception as err:
                log.debug("exit: destroying a process group failed: %s", err)


def _groups_not_ours() -> list[str]:
    """Names of the registered groups other than the package's default group (its GroupSets are gone by now)."""
    world = dist.distributed_c10d._get_default_group()
    names = dist.distributed_c10d._world.pg_names
    return [str(names.get(g, "?")) for g in list(dist.distributed_c10d._world.pg_map) if g is not world]


def release_torch_defaults() -> int:
    """Replace with None the default argument values of ``torch.distributed.nn.functional``'s functions that
    are process groups no longer registered (destroyed); how many. The one torch holder of groups (see
    [Note: clean exits by ownership]); a group still registered is left as it is."""
    module = sys.modules.get(TORCH_HOLDER)
    if module is None:
        return 0
    registered = dist.distributed_c10d._world.pg_map

    def stale(value: object) -> bool:
        return isinstance(value, dist.ProcessGroup) and value not in registered

    replaced = 0
    for fn in list(vars(module).values()):
        if not isinstance(fn, types.FunctionType) or fn.__module__ != TORCH_HOLDER:
            continue
        if fn.__defaults__ and any(stale(v) for v in fn.__defaults__):
            replaced += sum(stale(v) for v in fn.__defaults__)
            fn.__defaults__ = tuple(None if stale(v) else v for v in fn.__defaults__)
        for name, value in list((fn.__kwdefaults__ or {}).items()):
            if stale(value):
                fn.__kwdefaults__[name] = None  # type: ignore[index]
                replaced += 1
    return replaced


# [Note: leaving together]
# Measured with tests/comm/scripts/uneven_exit.py (one rank works on after training): 2 aborts in ~170
# launches with the group destroyed at exit, always on the rank that reached exit FIRST while its peer was
# still alive. So before tearing down the default group it created, the package's ranks meet: each marks
# its exit in the group's store and waits (bounded: EXIT_WAIT_ENV seconds, default 300) until every rank
# has, then all destroy the group at the same moment, as ranks that finish together do. A rank that failed
# never gets here (the handler returns first), so it never waits; its peers wait at most the bound (or
# until the launcher ends them, as torchrun does when a rank fails).
def _meet_peers_before_teardown() -> None:
    world = dist.get_world_size()
    if world == 1 or is_fake_group():  # a fake group has no peers to meet, and its store holds nothing
        return
    seconds = float(env.get(EXIT_WAIT_ENV) or "300")
    if seconds <= 0:
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"ds_strategy/exit/{dist.distributed_c10d._get_default_group().group_name}"
    store.set(f"{prefix}/{dist.get_rank()}", "1")
    try:
        store.wait([f"{prefix}/{r}" for r in range(world)], datetime.timedelta(seconds=seconds))
    except Exception as err:  # a peer that failed or works on for longer: tear down alone
        log.warning("exit: not every rank reached exit within %gs (%s); leaving without them", seconds, err)
