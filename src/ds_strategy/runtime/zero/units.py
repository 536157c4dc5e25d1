"""Stage 3's fetch units: which parameters are gathered together, by one all-gather into one flat buffer.

[Note: fetch units]
A *fetch unit* is a module whose whole subtree's parameters stage 3 gathers at once, before the unit's
forward (and again before its backward), as one flat bucket: one all-gather, and in backward one
reduce-scatter, whatever the number of tensors in it. Only unit modules carry gather hooks; the modules
inside a unit run with none (torch's fast call path).

The default policy, ``"blocks"``, is what FSDP2 users write by hand (``fully_shard`` on every transformer
block, then on the root): the entries of every ``nn.ModuleList`` / ``nn.Sequential`` whose entries are
structurally equal (at least two, all of one class, each with parameters)
are units, the outermost such lists only (a list inside a block is part of the block); every parameter
outside them (embeddings, final norm, output head) forms one more unit, the *rest*, gathered by the root
module's hooks and also by the hooks of the modules that own those parameters directly, so a call of
such a module outside the root's forward (a generate through an inner model) still finds them gathered.
A model without such a list keeps per-module units (the ``"modules"`` policy). A frozen rest much larger
than a block is split into its modules ([Note: a large frozen rest]).

The policy is overridable, from the most specific to the least:
* ``ds_strategy.zero.set_fetch_units(model, policy)`` (on the model, or on a LightningModule around it), with
  ``policy`` one of ``"blocks"``, ``"modules"``, a collection of module classes or class names, or a
  callable ``module -> bool``: the outermost modules it selects are units, the rest one more unit;
* the config key ``zero_optimization.stage3_fetch_units``: ``"blocks"`` (default), ``"modules"`` or a list
  of class names;
* ZeRO-3 leaf modules (``set_z3_leaf_modules``, ``leaf_module``) are units under every policy (a unit
  containing a leaf absorbs it; a leaf containing units absorbs them).

``"modules"`` is the previous behaviour: a module's unit is its direct parameters, a leaf's its subtree.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import nn

from .leaf import LEAF_ATTR, _matches, outermost_leaves

POLICY_ATTR = "_ds_fetch_units"  # on the root module: set_fetch_units' policy
BLOCKS = "blocks"
MODULES = "modules"

REST_SPLIT = 2  # a frozen rest larger than this many times the largest unit is split (see the note)

FetchUnitPolicy = str | Collection[type[nn.Module] | str] | Callable[[nn.Module], bool]


def set_fetch_units(model: nn.Module, policy: FetchUnitPolicy | None) -> None:
    """Choose how stage 3 groups ``model``'s parameters into fetch units (see [Note: fetch units]); None
    returns to the config's choice. Call it before the engine is built (the bucket layout follows it)."""
    check_policy(policy, "set_fetch_units")
    if policy is None:
        if hasattr(model, POLICY_ATTR):
            delattr(model, POLICY_ATTR)
        return
    setattr(model, POLICY_ATTR, policy)


def check_policy(policy: Any, where: str) -> None:
    """Raise a ``ValueError`` / ``TypeError`` naming ``where`` for a policy that is none of the valid kinds."""
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return
    if isinstance(policy, str):
        if policy not in (BLOCKS, MODULES):
            raise ValueError(
                f"{where}: fetch-unit policy {policy!r} is not valid; use 'blocks' (one unit per repeated block, "
                "the default), 'modules' (one unit per module), a collection of module classes or class names, or "
                "a callable module -> bool"
            )
        return
    items = list(policy) if isinstance(policy, Iterable) else [policy]
    bad = [c for c in items if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module)))]
    if bad or not items:
        raise TypeError(
            f"{where}: a fetch-unit policy collection holds nn.Module classes or class names, got {bad or items!r}"
        )


def policy_of(root: nn.Module, configured: FetchUnitPolicy | None) -> FetchUnitPolicy:
    """The policy in force for ``root``: set_fetch_units' (on ``root`` or a child, for a Lightning module
    wrapping the model), else the config's, else ``"blocks"``."""
    for m in root.modules():
        chosen = getattr(m, POLICY_ATTR, None)
        if chosen is not None:
            return chosen
    return configured if configured is not None else BLOCKS


def repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """The entries of the outermost ``nn.ModuleList`` / ``nn.Sequential`` containers whose entries are
    structurally equal (see [Note: fetch units]), in ``modules()`` order."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and _equal_entries(list(module.children())):
            out.extend(module.children())
            return
        for child in module.children():
            visit(child)

    visit(root)
    return out


def _equal_entries(entries: list[nn.Module]) -> bool:
    """At least two entries, all of one class, each with parameters. The class is the test, not the exact
    parameter shapes: T5's first block alone holds the relative attention bias, and is still a block."""
    if len(entries) < 2:
        return False
    kind = type(entries[0])
    return all(type(e) is kind and next(e.parameters(), None) is not None for e in entries)


def _selected(root: nn.Module, policy: FetchUnitPolicy) -> list[nn.Module] | None:
    """The modules the policy makes units (before leaves are added), or None for per-module units."""
    if policy == MODULES:
        return None
    if policy == BLOCKS:
        return repeated_blocks(root) or None
    if callable(policy) and not isinstance(policy, type):
        return [m for m in root.modules() if m is not root and policy(m)]
    wanted = list(policy) if isinstance(policy, Iterable) and not isinstance(policy, str) else [policy]
    return [m for m in root.modules() if m is not root and any(_matches(m, c) for c in wanted)]


def unit_owners(
    root: nn.Module, policy: FetchUnitPolicy, numel: Callable[[torch.Tensor], int] = torch.Tensor.numel
) -> dict[int, nn.Module]:
    """``id(module)`` -> the unit module whose hooks gather ``module``'s direct parameters, for every module
    of ``root``: itself under per-module units (its outermost leaf inside a leaf); its unit, or ``root`` for
    the rest, under the other policies (see [Note: fetch units]). ``numel``: a parameter's full size (its
    storage may be a partition or a placeholder by now)."""
    chosen = _selected(root, policy)
    leaves = outermost_leaves(root)
    if chosen is None:
        return {id(m): leaves.get(id(m), m) for m in root.modules()}
    marked = {id(m) for m in chosen} | {id(m) for m in root.modules() if getattr(m, LEAF_ATTR, False)}
    out: dict[int, nn.Module] = {}

    def visit(module: nn.Module, unit: nn.Module) -> None:
        if unit is root and id(module) in marked:
            unit = module
        out.setdefault(id(module), unit)
        for child in module.children():
            visit(child, unit)

    visit(root, root)
    _split_large_frozen_rest(root, out, numel)
    return out


def _split_large_frozen_rest(
    root: nn.Module, owners: dict[int, nn.Module], numel: Callable[[torch.Tensor], int]
) -> None:
    """[Note: a large frozen rest] When the rest holds more than ``REST_SPLIT`` times the largest unit's
    parameters and trains none of them (a LoRA or other adapter fine-tune of a large-vocabulary model: the
    frozen embedding and head are most of the rest, a large part of the model), each of its modules becomes
    a unit of its own: the embedding is then gathered for the embedding only and the head for the head,
    not both for the whole forward, which would hold about as much as partitioning saves. Frozen
    parameters are never reduced, so this costs no reduce-scatter; a trained rest stays one unit (one
    reduce-scatter in backward)."""
    units: dict[int, nn.Module] = {id(u): u for u in owners.values() if u is not root}
    if not units:
        return
    rest = [m for m in root.modules() if owners[id(m)] is root and m._parameters]
    rest_params = {id(p): p for m in rest for p in m._parameters.values() if p is not None}
    if any(p.requires_grad for p in rest_params.values()):
        return
    largest = max(sum(numel(p) for p in u.parameters()) for u in units.values())
    if sum(numel(p) for p in rest_params.values()) > REST_SPLIT * largest:
        for m in rest:
            owners[id(m)] = m
