"""Checkpoint chosen submodules in place: what ``ZeroStrategy(activation_checkpointing_policy=...)`` does.

A policy is what Lightning's FSDPStrategy takes: a set of module classes (every instance is checkpointed)
or a callable ``policy(module) -> bool`` (torch's auto-wrap signature ``(module, recurse, nonwrapped_numel)``
is accepted too: it is asked with ``recurse=False``).

[Note: checkpointing a module in place]
A wrapper module (torch's ``CheckpointWrapper``) would rename every parameter (``_checkpoint_wrapped_module.``
in state-dict keys, checkpoints and Hugging Face weight names). Instead, like Hugging Face's
``GradientCheckpointingLayer``, the module's class is swapped for a subclass whose ``__call__`` runs the
*whole* call - forward pre-hooks, forward, forward hooks - inside the checkpoint. Running the hooks inside
matters for ZeRO-3: the recomputation then gathers the module's own parameters again (its pre-hook) and
releases them after, exactly as the first forward did. Names, ``isinstance`` and the hierarchy are unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from .checkpoint import checkpoint, non_reentrant_checkpoint

Policy = Iterable[type[nn.Module]] | Callable[..., bool]
_MARK = "_ds_checkpointed"
_SUBCLASSES: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {}


def _decider(policy: Policy) -> Callable[[nn.Module], bool]:
    if callable(policy) and not isinstance(policy, type):
        params = inspect.signature(policy).parameters
        if len(params) >= 3:  # torch's auto-wrap policy signature
            return lambda m: bool(policy(module=m, recurse=False, nonwrapped_numel=0))
        return lambda m: bool(policy(m))
    classes = tuple(policy)  # type: ignore[arg-type]  # a set of classes (callables returned above)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"activation_checkpointing_policy must be a set of nn.Module classes or a callable(module) -> bool, "
            f"got {policy!r}"
        )
    return lambda m: isinstance(m, classes)


_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")  # HF's names for a layer's cache


def _checkpointed_class(cls: type[nn.Module], reentrant: bool) -> type[nn.Module]:
    key = (cls, reentrant)
    if key not in _SUBCLASSES:
        run = checkpoint if reentrant else non_reentrant_checkpoint

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            call = super(sub, self).__call__  # type: ignore[arg-type]  # the whole hooked call (see the note)
            if not self.training or not _grad_wanted():
                return call(*args, **kwargs)
            # The recomputation runs the layer again: a key/value cache (Hugging Face layers) would be appended
            # to twice. Training needs none, so the checkpointed call runs without one (as HF's own does).
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            for name in _CACHE_KWARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            return run(functools.partial(call, **kwargs) if kwargs else call, *args)

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            # Pickle by the original class (the subclass is made at run time, so no name finds it) and
            # rebuild the checkpointed subclass on load: torch.save(model) and deepcopy keep working.
            _new, _args, *rest = object.__reduce_ex__(self, max(2, protocol))  # type: ignore[str-unpack]
            return (_new_checkpointed, (cls, reentrant), *rest)

        namespace = {"__call__": __call__, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__, _MARK: True}
        sub = type(cls.__name__, (cls,), namespace)
        sub.__qualname__ = cls.__qualname__
        _SUBCLASSES[key] = sub
    return _SUBCLASSES[key]


def _new_checkpointed(cls: type[nn.Module], reentrant: bool) -> nn.Module:
    return object.__new__(_checkpointed_class(cls, reentrant))


def _grad_wanted() -> bool:
    import torch

    return torch.is_grad_enabled()


def apply_activation_checkpointing(module: nn.Module, policy: Policy, *, reentrant: bool = False) -> list[str]:
    """Checkpoint every submodule the policy picks (the outermost only: a picked module's children are
    not checkpointed again). Returns the names of the checkpointed modules. Idempotent."""
    decide = _decider(policy)
    picked: list[str] = []
    skip: tuple[str, ...] = ()
    for name, m in module.named_modules():
        if skip and any(name.startswith(s) for s in skip):
            continue
        if getattr(type(m), _MARK, False):
            skip += (name + ".",)
            continue
        if m is not module and decide(m):
            m.__class__ = _checkpointed_class(type(m), reentrant)
            picked.append(name)
            skip += (name + ".",)
    return picked


def is_checkpointed(module: nn.Module) -> bool:
    return bool(getattr(type(module), _MARK, False))
