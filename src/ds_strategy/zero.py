"""``ds_strategy.zero``: DeepSpeed's ``deepspeed.zero`` helpers for ZeRO stage 3.

- ``Init(...)``: build a model with its parameters partitioned across the data-parallel ranks.
- ``GatheredParameters(params, modifier_rank=None)``: temporary full access; the modifier's edits are kept.
- ``register_external_parameter(module, param)``: gather ``param`` whenever ``module`` runs.
- ``set_z3_leaf_modules(model, classes)`` / ``unset_z3_leaf_modules`` / ``get_z3_leaf_modules`` (and the
  ``z3_leaf_module`` / ``z3_leaf_parameter`` predicates): gather a module's whole subtree as one unit.
- ``set_fetch_units(model, policy)``: which modules stage 3 gathers as one flat buffer ("blocks" by default,
  "modules", module classes or a callable; see docs/zero3.md).
"""

from __future__ import annotations

from ds_strategy.runtime.zero.gathered import GatheredParameters, register_external_parameter
from ds_strategy.runtime.zero.init import Init
from ds_strategy.runtime.zero.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from ds_strategy.runtime.zero.units import set_fetch_units

__all__ = [
    "GatheredParameters",
    "Init",
    "get_z3_leaf_modules",
    "register_external_parameter",
    "set_fetch_units",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
