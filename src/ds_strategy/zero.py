"""``ds_strategy.zero``: DeepSpeed's ``deepspeed.zero`` helpers for ZeRO stage 3.

- ``Init(...)``: build a model with its parameters partitioned across the data-parallel ranks.
- ``GatheredParameters(params, modifier_rank=None)``: temporary full access; the modifier's edits are kept.
- ``register_external_parameter(module, param)``: gather ``param`` whenever ``module`` runs.
"""

from __future__ import annotations

from ds_strategy.runtime.zero.gathered import GatheredParameters, register_external_parameter
from ds_strategy.runtime.zero.init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
