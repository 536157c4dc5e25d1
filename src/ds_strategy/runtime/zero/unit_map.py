"""Stage 3's fetch units as bucket keys: which partitioned buckets each module's fetch gathers, kept current
when leaf flags change or external parameters are registered (see [Note: gather units and hooks] in
param_gather.py and [Note: fetch units] in units.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..layout import BucketKey
from .leaf import leaf_generation
from .sharded import ShardedGroup
from .tiled import TiledWeight, tiled_weights
from .units import FetchUnitPolicy, unit_owners

EXTERNAL_ATTR = "_ds_external_params"
# torch modules whose forward reads their children's parameters without calling the children
# (MultiheadAttention passes ``out_proj.weight`` to the functional attention): their unit is the subtree.
READS_CHILD_PARAMETERS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


class UnitMap:
    """Every module's unit, ``units[id(module)]``, its frozen buckets, ``frozen_units``, and the tiled
    modules, ``tiled`` (which have no unit: [Note: tiled frozen weights] in tiled.py). The dicts are updated
    in place, never replaced: the gatherer, its hooks and its prefetch planner read the same ones."""

    def __init__(
        self, groups: Sequence[ShardedGroup], root: nn.Module, policy: FetchUnitPolicy, *, tile_frozen: bool = False
    ) -> None:
        self.groups = groups
        self.root = root
        self.policy = policy
        self.tile_frozen = tile_frozen
        self.bucket_of: dict[int, BucketKey] = {}
        for g, gs in enumerate(groups):
            for i, p in enumerate(gs.params):
                b = gs.layout.params[i].bucket
                if b not in gs.persistent:
                    self.bucket_of[id(p)] = (g, b)
        self.units: dict[int, list[BucketKey]] = {}
        self.frozen_units: dict[int, list[BucketKey]] = {}
        self.tiled: dict[int, TiledWeight] = {}
        self._generation = -1
        self.compute()

    def keys_of(self, params: Iterable[torch.Tensor | None]) -> list[BucketKey]:
        return sorted({self.bucket_of[id(p)] for p in params if p is not None and id(p) in self.bucket_of})

    def compute(self) -> None:
        """Every module's unit (see [Note: gather units and hooks] and [Note: fetch units] in units.py): a
        unit module's is its whole subtree, the modules inside it have none; a leaf module is a unit under
        every policy. Externals registered on a module inside a unit join that unit. The modules owning
        parameters of the rest unit directly fetch it too (calls outside the root's forward)."""
        self._generation = leaf_generation()
        sizes = {id(p): s.numel for gs in self.groups for p, s in zip(gs.params, gs.layout.params, strict=True)}
        owners = unit_owners(self.root, self.policy, lambda p: sizes.get(id(p), p.numel()))
        params: dict[int, list[torch.Tensor | None]] = defaultdict(list)
        holders: list[nn.Module] = []
        readers: dict[int, int] = defaultdict(int)  # id(parameter) -> modules reading it (own or external)
        for m in self.root.modules():
            owner = owners[id(m)]
            direct = list(m.parameters(recurse=False)) + list(getattr(m, EXTERNAL_ATTR, []))
            for p in direct:
                readers[id(p)] += 1
            params[id(owner)] += direct
            if owner is m and isinstance(m, READS_CHILD_PARAMETERS):
                params[id(m)] += list(m.parameters())
            if owner is self.root and m is not self.root and self.keys_of(direct):
                holders.append(m)
        units = {id(m): self.keys_of(params.get(id(m), [])) for m in self.root.modules()}
        for m in holders:
            units[id(m)] = units[id(self.root)]
        self.tiled.clear()
        if self.tile_frozen:
            self.tiled.update(tiled_weights(self.root, units, self.groups, readers))
            for mid in self.tiled:
                units[mid] = []
        self.units.clear()
        self.units.update(units)
        self.frozen_units.clear()
        self.frozen_units.update(
            (mid, frozen) for mid, keys in units.items() if (frozen := [k for k in keys if self.groups[k[0]].frozen])
        )

    def refresh(self) -> bool:
        """Compute the units again if leaf flags changed since (see [Note: leaf modules] in leaf.py); whether
        any unit changed."""
        if self._generation == leaf_generation():
            return False
        before = dict(self.units)
        self.compute()
        return self.units != before
