"""``ds_strategy.moe``: DeepSpeed's ``deepspeed.moe`` surface (mixture of experts; docs/moe.md).

- ``MoE(hidden_size, expert, num_experts=1, ep_size=1, k=1, ...)``: the layer; ``forward`` returns
  ``(output, l_aux, exp_counts)``.
- ``TopKGate``, ``top1gating``, ``top2gating``: the gates.
- ``split_params_into_different_moe_groups_for_optimizer(groups)``: dense and expert param groups apart.
- ``set_expert_groups(model)``: build the expert-parallel groups without the engine (the engine does it).
- ``has_moe_layers``, ``moe_layers``, ``is_moe_param``, ``ExpertGroups``.
"""

from __future__ import annotations

# The runtime package's public names, as they are (one list: ``ds_strategy.runtime.moe.__all__``).
from ds_strategy.runtime.moe import *  # noqa: F403
from ds_strategy.runtime.moe import __all__ as __all__
