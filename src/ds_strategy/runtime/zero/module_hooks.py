"""Stage 3's module hooks: the forward hooks on the root and on each module with a unit, and the gradient
hooks they leave on a forward's outputs and inputs, which tell the gatherer when to fetch and release units
(see [Note: gather units and hooks] in param_gather.py); removed while a hold suspends them.

[Note: frozen buckets in backward]
Buckets of frozen parameters (see [Note: frozen parameters] in stage3.py) get no gradient, so no
post-accumulate-grad hook frees them. Backward still needs them (the gradient w.r.t. a frozen Linear's
input reads its weight), so they are gathered before the module's backward like the others, and freed
by a multi-grad hook on the module's *inputs*: once the gradients w.r.t. every input that requires one
are computed, the module's backward is over. A module whose inputs need no gradient (the first layer)
keeps its frozen buckets until ``end_backward``, which frees everything.

[Note: prefetch after release]
In backward a module's unit is gathered by a hook on its output's gradient, and the frozen buckets of the
module after it are freed by a hook on that module's inputs' gradients: for sequential blocks the same
tensor, whose hooks run in the order they were registered, the fetch first (registered by the earlier
block's forward). Prefetching the next block there would hold three blocks for a moment: the one whose
backward just ended, the one starting, the one ahead; the host pool then keeps a third block-sized
buffer for the rest of the run (on the LoRA rank of benchmarks/bench_lora_lightning.py, 14.5 MiB of the
121 partitioning saves). So the backward fetch gathers what the module needs at once, and its prefetch
waits for a pre-hook on the node(s) that produced the output: node pre-hooks run after all of a node's
tensor hooks, the release included, and just before the module's backward computes, which the prefetch
then overlaps.

[Note: the graph holds the hooks weakly]
The gradient hooks live as long as the autograd graph they sit on, and a graph can outlive its step: a
caller keeps the last loss with its ``grad_fn`` (Lightning's closure result), or torch's own multi-grad
hook (its "all" mode keeps the nodes it waits on inside the hooks those nodes hold) leaves a cycle that
passes through C++. Holding the hooks object strongly, such a graph kept the gatherer, its groups and
every partition alive after the engine was destroyed (the LoRA rank of benchmarks/bench_lora_lightning.py:
120 MiB of frozen partition still resident after ``fit``). So the hooks reach this object through a weak
reference and do nothing once it is gone.

[Note: the graph holds nothing of itself]
A gradient hook lives in the autograd node it sits on, and a hook that holds that node (or one reachable
from it) makes a cycle through C++, which Python's collector cannot follow: the whole graph of every step
then stayed alive after its backward (on a 64-block model ~1,400 objects a step, and full collections over
the growing heap paused steps for 0.2-0.4 s every ~65 steps; tests/runtime/test_step_leaks.py). So:

* The fetch hook on a module's outputs holds the module only; the prefetch pre-hooks go on the output's
  nodes at forward time (a node's pre-hook holds nothing of the graph) instead of being registered from the
  fetch hook, which had to hold the nodes.
* The frozen release needs every input gradient of the module (torch's ``register_multi_grad_hook`` in
  its "all" mode), and counting them needs the inputs' nodes (which of them this backward runs). torch's
  own "all" mode keeps them inside the hooks those nodes hold: the cycle. Here this object keeps them
  (``_waiting``, by token; the hooks hold the token and a weak reference to this object), drops each entry
  when its release fires, and drops the rest at the end of backward and when a forward begins two
  forwards with gradients after theirs (a graph never backwarded is not kept alive by it).

[Note: compiled regions]
Under ``compile`` (runtime/compile.py) stage 3 compiles each repeated block's forward and marks the block
a leaf: its unit is its whole subtree, gathered by the block's own hooks, which run eagerly around the
compiled forward. Its descendants have no unit, so their hooks would do nothing, but inside a compiled
forward dynamo would trace them and guard on each module's identity (one recompile per block). So the
modules inside a compiled region get no hooks at all (``unhook_inside``): nothing inside a graph gathers,
releases or communicates, and one graph serves every block.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from ..autograd_engine import current_backward, node_of, nodes_to_run
from ..layout import BucketKey


class HookTarget(Protocol):
    """What the hooks call (``ParamGatherer`` in param_gather.py)."""

    def begin_forward(self) -> None: ...

    def check_agreement(self) -> None: ...

    def fetch(self, module: nn.Module, *, prefetch: bool = True) -> None: ...

    def prefetch_after(self, module: nn.Module) -> None: ...

    def release(self, module: nn.Module) -> None: ...

    def release_keys(self, keys: Sequence[BucketKey]) -> None: ...

    def enter_tiled(self, module: nn.Module) -> None: ...

    def exit_tiled(self, module: nn.Module) -> None: ...


@dataclass
class _Waiting:
    """A frozen release waiting for the gradients w.r.t. a module's inputs ([Note: the graph holds nothing
    of itself]): the inputs' nodes, the keys to release, the forward it was made in, and per backward (graph
    task) the gradients seen and expected."""

    nodes: list[Any]
    keys: Sequence[BucketKey]
    forward: int
    seen: dict[int, int] = field(default_factory=dict)
    expected: dict[int, int] = field(default_factory=dict)


class ModuleHooks:
    """The root's hooks and those of the modules with a unit: attached, detached, suspended during a hold
    (see [Note: held buckets] in param_gather.py). ``units`` and ``frozen_units`` are the ``UnitMap``'s
    (unit_map.py)."""

    def __init__(
        self,
        root: nn.Module,
        units: Mapping[int, list[BucketKey]],
        frozen_units: Mapping[int, list[BucketKey]],
        target: HookTarget,
        tiled: Mapping[int, Any] | None = None,
    ) -> None:
        self.root = root
        self.units = units
        self.frozen_units = frozen_units
        self.tiled = tiled if tiled is not None else {}  # [Note: tiled frozen weights] in tiled.py
        # the target's calls, bound once: a hook costs what it cost as the target's own method
        self._begin_forward = target.begin_forward
        self._check_agreement = target.check_agreement
        self._fetch = target.fetch
        self._prefetch_after = target.prefetch_after
        self._release = target.release
        self._release_keys = target.release_keys
        self._enter_tiled = target.enter_tiled
        self._exit_tiled = target.exit_tiled
        self._hooks: list[RemovableHandle] = []  # the root's
        self._module_hooks: list[RemovableHandle] = []  # the other unit modules'
        self.unhooked: set[int] = set()  # modules inside compiled regions: see [Note: compiled regions]
        self.suspended = False  # see [Note: held buckets] in param_gather.py
        self._reattach = False  # resume puts the hooks back (they were attached when the hold began)
        # frozen releases by token: [Note: the graph holds nothing of itself]
        self._waiting: dict[int, _Waiting] = {}
        self._tokens = 0
        self._forwards = 0  # root forwards with gradients so far
        self._lock = threading.Lock()  # backward may run hooks on one thread per device

    # ------------------------------------------------------------------ attach / detach
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

    def detach(self) -> None:
        self._reattach = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._unhook_modules()

    def rehook(self) -> None:
        """The units changed: hook the modules that have one now, if attached (the root's hooks are kept)."""
        if self._hooks:
            self._unhook_modules()
            self._hook_modules()

    def unhook_inside(self, regions: Iterable[nn.Module]) -> None:
        """Hook no module strictly inside ``regions``, leaf modules compiled as a whole (see [Note: compiled
        regions]); takes effect now if attached."""
        self.unhooked |= {id(m) for region in regions for m in region.modules() if m is not region}
        if self._hooks:
            self.detach()
            self.attach()

    def suspend(self) -> None:
        """A hold begins (see [Note: held buckets]): the hooks are removed until ``resume``."""
        if not self.suspended:
            attached = bool(self._hooks)
            self.detach()
            self._reattach = attached
        self.suspended = True

    def resume(self) -> None:
        """The hold ended: the hooks are put back if they were attached."""
        self.suspended = False
        if self._reattach:
            self._reattach = False
            self.attach()

    def _hook_modules(self) -> None:
        """Hooks on the modules with a unit only: the modules inside a unit take torch's fast call path."""
        for m in self.root.modules():
            if m is self.root or id(m) in self.unhooked:
                continue
            if id(m) in self.tiled:  # computed from tiles inside its forward: nothing gathered around it
                self._module_hooks.append(m.register_forward_pre_hook(self._pre_tiled))
                self._module_hooks.append(m.register_forward_hook(self._post_tiled, always_call=True))
                continue
            if not self.units.get(id(m)):
                continue
            self._module_hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._module_hooks.append(m.register_forward_hook(self._post_forward, with_kwargs=True))

    def _unhook_modules(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks.clear()

    # ------------------------------------------------------------------ the hooks
    def _on_root_start(self, module: nn.Module, args: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        self._forwards += torch.is_grad_enabled()  # forwards that build a graph
        if self._waiting:  # a graph two forwards old is not backwarded any more, or only with everything freed
            stale = [t for t, w in self._waiting.items() if w.forward < self._forwards - 1]
            for token in stale:
                del self._waiting[token]
        self._begin_forward()

    def _on_root_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        if not torch.is_grad_enabled():  # no backward follows: nothing stays gathered for it
            self._check_agreement()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        self._fetch(module)

    def _pre_tiled(self, module: nn.Module, args: Any) -> None:
        if not self.suspended:
            self._enter_tiled(module)

    def _post_tiled(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.suspended:
            self._exit_tiled(module)

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.suspended:  # see [Note: held buckets]
            return
        if not self.units.get(id(module)):
            return
        if torch.is_grad_enabled():
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                me = weakref.ref(self)  # see [Note: the graph holds the hooks weakly]
                # No hook holds a node of this graph: [Note: the graph holds nothing of itself]
                nodes = list({id(t.grad_fn): t.grad_fn for t in outs if t.grad_fn is not None}.values())
                for node in nodes:  # run after the node's tensor hooks: [Note: prefetch after release]
                    node.register_prehook(lambda grad_outputs, m=module: _prefetch_for_backward(me, m))
                register_multi_grad_hook(
                    outs, lambda grads, m=module, d=bool(nodes): _fetch_for_backward(me, m, d), mode="any"
                )
                frozen = self.frozen_units.get(id(module))
                if frozen:  # see [Note: frozen buckets in backward]
                    ins = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                    if ins:
                        self._release_after_inputs(ins, frozen, me)
        self._release(module)

    def _release_after_inputs(
        self, ins: list[torch.Tensor], keys: Sequence[BucketKey], me: weakref.ref[ModuleHooks]
    ) -> None:
        """Release ``keys`` once the gradient w.r.t. every input in ``ins`` that this backward computes is in
        (torch's multi-grad "all" mode, its nodes kept here: [Note: the graph holds nothing of itself])."""
        self._tokens += 1
        token = self._tokens
        self._waiting[token] = _Waiting([node_of(t) for t in ins], keys, self._forwards)
        for t in ins:
            t.register_hook(lambda grad, k=token: _input_grad_in(me, k))

    def input_grad_in(self, token: int) -> None:
        """One gradient w.r.t. an input of a frozen unit is in: at the last one this backward computes, its
        frozen buckets are released."""
        with self._lock:
            waiting = self._waiting.get(token)
            if waiting is None:  # dropped (end of backward, or a stale graph): end_backward frees everything
                return
            task = current_backward()
            seen = waiting.seen.get(task, 0) + 1
            if seen == 1:  # which of the inputs' nodes this backward runs (torch's own count)
                waiting.expected[task] = nodes_to_run(waiting.nodes)
            done = seen >= waiting.expected[task]
            if done:
                del self._waiting[token]
            else:
                waiting.seen[task] = seen
        if done:
            self._release_keys(waiting.keys)

    def end_backward(self) -> None:
        """Backward is over (everything gathered is freed): no frozen release is waiting any more."""
        self._waiting.clear()

    def backward_fetch(self, module: nn.Module, deferred: bool) -> None:
        """The gradient w.r.t. ``module``'s output is ready: gather its unit now; ``deferred``: prefetch when
        the nodes that produced the output start (their pre-hooks, see [Note: prefetch after release])."""
        self._fetch(module, prefetch=not deferred)

    def prefetch_after(self, module: nn.Module) -> None:
        self._prefetch_after(module)


def _fetch_for_backward(me: weakref.ref[ModuleHooks], module: nn.Module, deferred: bool) -> None:
    hooks = me()
    if hooks is not None:
        hooks.backward_fetch(module, deferred)


def _prefetch_for_backward(me: weakref.ref[ModuleHooks], module: nn.Module) -> None:
    """A node that produced ``module``'s output starts: the prefetch its backward fetch left (a no-op for
    the other nodes, or where nothing was fetched)."""
    hooks = me()
    if hooks is not None:
        hooks.prefetch_after(module)


def _input_grad_in(me: weakref.ref[ModuleHooks], token: int) -> None:
    hooks = me()
    if hooks is not None:
        hooks.input_grad_in(token)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
