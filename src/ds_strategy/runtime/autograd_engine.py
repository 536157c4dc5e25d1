"""What torch's autograd engine says about the backward it is running, for hooks that count gradients
(stage 3's frozen release, [Note: the graph holds nothing of itself] in zero/module_hooks.py).

torch's ``register_multi_grad_hook(mode="all")`` counts the same way, through the same private calls; it is
not used because its hooks hold the nodes they count, a cycle through C++ that keeps each step's graph
alive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def node_of(t: torch.Tensor) -> Any:
    """The node whose run computes ``t``'s gradient: its ``grad_fn``, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def current_backward() -> int:
    """The id of the backward (graph task) running this hook; -1 outside one."""
    return int(torch._C._current_graph_task_id())


def nodes_to_run(nodes: Iterable[Any]) -> int:
    """How many of ``nodes`` the running backward executes (call from a hook inside it)."""
    return sum(bool(torch._C._will_engine_execute_node(n)) for n in nodes)
