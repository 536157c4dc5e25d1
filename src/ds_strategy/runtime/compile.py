"""torch.compile through the engine: the ``compile`` config block and ``engine.compile()``.

[Note: what is compiled]
The engine never compiles its own ``forward`` (it runs the stage's context, timers and profiler) and
never the hooks of the stages; it replaces the ``forward`` of chosen modules (*regions*) with a compiled
one, as an instance attribute, so ``module(...)`` still runs that module's own hooks eagerly around it:

- stages 0-2: the region is the module itself (the whole forward in one graph). Their gradient hooks are
  post-accumulate-grad hooks on the parameters: autograd runs them eagerly after the compiled backward
  has produced the gradients, so no hook is traced and the reductions run where they do eagerly.
- stage 3: the regions are the repeated blocks, the children of the outermost ``nn.ModuleList`` (else the
  module's direct children that hold parameters). Each block becomes a ZeRO-3 leaf (its whole subtree is
  one gather unit, gathered by the block's own hooks at its boundary) and the modules inside it lose
  their hooks (see [Note: compiled regions] in zero/module_hooks.py). Compiling the whole module instead
  would trace the gather hooks of every submodule: a graph break (or an error) per layer.

Modules checkpointed by ``activation_checkpointing_policy`` run their checkpoint (a stash and an RNG replay:
Python state) eagerly: a region that contains some is replaced by the outermost of them, each compiled
inside its checkpoint.

Every region shares its class's ``forward`` code, so the blocks of a model share one graph: the number of
graphs does not grow with the number of layers, and later steps compile nothing (tests/runtime/
test_compile.py counts both). ``eager()`` switches back to the original forwards for a while (the hybrid
engine's generate: decoding with a KV cache would compile a graph per sequence length).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ds_strategy.config.errors import ConfigError, ConfigProblem
from ds_strategy.log import get_logger

from .activation_checkpointing import is_checkpointed
from .zero.leaf import set_z3_leaf_module

log = get_logger("ds_strategy.runtime")

Backend = str | Callable[..., Any]

# torch.compile's keywords besides ``model`` and ``backend`` (the backend has its own key / argument).
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")
_FORWARD_ATTR = "_ds_compiled_forward"  # on a region: (the original forward, the compiled one)


def valid_backends() -> list[str]:
    """The backend names torch.compile accepts here (the debugging ones included)."""
    import torch._dynamo

    return sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"eager", "aot_eager", "inductor"})


def check_backend(backend: Backend, key: str = "compile.backend") -> None:
    """A ``ConfigError`` naming ``key`` and the valid names when ``backend`` is an unknown name."""
    if callable(backend):
        return
    if not isinstance(backend, str) or backend not in valid_backends():
        raise ConfigError(
            [ConfigProblem(key, f"unknown torch.compile backend {backend!r}; valid: {', '.join(valid_backends())}")]
        )


def check_kwargs(kwargs: Mapping[str, Any], key: str = "compile.kwargs") -> dict[str, Any]:
    """``kwargs`` as a dict; a ``ConfigError`` naming ``key`` for a keyword torch.compile does not take."""
    unknown = sorted(set(kwargs) - set(COMPILE_KWARGS))
    if unknown:
        hint = " (the backend has its own key: compile.backend / backend=)" if "backend" in unknown else ""
        raise ConfigError(
            [
                ConfigProblem(
                    key, f"{', '.join(unknown)} not torch.compile keywords; valid: {', '.join(COMPILE_KWARGS)}{hint}"
                )
            ]
        )
    return dict(kwargs)


def compile_regions(module: nn.Module, *, per_block: bool) -> list[nn.Module]:
    """The modules whose forward is compiled (see [Note: what is compiled]), each moved inward to the
    checkpointed modules it contains, if any (see ``_outside_checkpoints``)."""
    return [r for region in _regions(module, per_block=per_block) for r in _outside_checkpoints(region)]


def _outside_checkpoints(region: nn.Module) -> list[nn.Module]:
    """``region``, or, when modules strictly inside it are checkpointed by ``activation_checkpointing_policy``,
    the outermost of those: the checkpoint (its stash and RNG replay: Python state dynamo cannot trace) runs
    eagerly around each compiled forward instead of inside a graph."""
    if is_checkpointed(region):
        return [region]
    inner: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if is_checkpointed(child):
                inner.append(child)
            else:
                visit(child)

    visit(region)
    return inner or [region]


def _regions(module: nn.Module, *, per_block: bool) -> list[nn.Module]:
    if not per_block:
        return [module]
    blocks: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(b for b in child if any(True for _ in b.parameters()))
            else:
                visit(child)

    visit(module)
    if blocks:
        return blocks
    return [c for c in module.children() if any(True for _ in c.parameters())]


def mark_leaves(regions: list[nn.Module]) -> None:
    """Make each stage-3 region a ZeRO-3 leaf (one gather unit), unless it is one already."""
    for region in regions:
        if not getattr(region, "_z3_leaf", False):
            set_z3_leaf_module(region, True)


class CompiledForwards:
    """The compiled forwards of one engine's module (see [Note: what is compiled])."""

    def __init__(self) -> None:
        self.regions: list[nn.Module] = []
        self.backend: Backend | None = None
        self.kwargs: dict[str, Any] = {}
        self._eager_depth = 0

    @property
    def is_compiled(self) -> bool:
        return bool(self.regions)

    def compile(self, regions: list[nn.Module], backend: Backend, kwargs: Mapping[str, Any], *, leaves: bool) -> None:
        """Compile each region's forward; ``leaves``: make each region a ZeRO-3 leaf (stage 3)."""
        check_backend(backend)
        options = check_kwargs(kwargs)
        if leaves:
            mark_leaves(regions)
        shared: dict[Any, Callable[..., Any]] = {}  # one compiled function per forward code: one graph for all blocks
        for region in regions:
            original = region.forward
            code = getattr(original, "__func__", original)
            if code not in shared:
                shared[code] = torch.compile(code, backend=backend, **options)
            compiled = shared[code]
            bound = functools.partial(compiled, region) if hasattr(original, "__func__") else compiled
            self._install(region, original, bound)
        self.regions = regions
        self.backend, self.kwargs = backend, options
        log.info("compiled %d region(s) (backend %s)", len(regions), getattr(backend, "__name__", backend))

    def _install(self, region: nn.Module, original: Callable[..., Any], compiled: Callable[..., Any]) -> None:
        switch = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            return (original if switch._eager_depth else compiled)(*args, **kwargs)

        region.forward = forward
        setattr(region, _FORWARD_ATTR, original)

    @contextmanager
    def eager(self) -> Iterator[None]:
        """Run the original (uncompiled) forwards inside."""
        self._eager_depth += 1
        try:
            yield
        finally:
            self._eager_depth -= 1

    def restore(self) -> None:
        """Put the original forwards back (the ZeRO-3 leaf flags stay)."""
        for region in self.regions:
            original = region.__dict__.pop(_FORWARD_ATTR, None)
            region.__dict__.pop("forward", None)
            if original is not None and getattr(original, "__self__", None) is not region:
                region.forward = original
        self.regions = []
