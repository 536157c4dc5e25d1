"""The engine's only door to the data-parallel group: ``ds_strategy.comm``'s ``Communicator`` with the
conventions the stages rely on.

Everything the facade does applies to gradients and parameters too: the shared-memory fast path for CPU
ranks on one node, gloo's reduce_scatter / all_gather through all_reduce (see the notes in
``ds_strategy.comm.collectives``), nccl's native collectives, and the comms logger. The stages add two
conventions: every reduction is a sum (averaging is folded into the pre/post scale factors), and a
reduce-scatter may consume its input (the bucket it reduces is scratch once launched, so the gloo path
saves one copy of it).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ds_strategy.comm.collectives import CommHandle, Communicator


class Handle(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


DONE: Handle = _Done()


def advance(handle: Handle) -> None:
    """Issue what ``handle``'s collective has left to issue (qgZ's second all-to-all: a ``TwoStepHandle``,
    or a handle wrapping one); nothing for a one-step collective. A collective: call it where every rank
    calls it, in the same order ([Note: when step 2 is issued] in comm/quantized_all_to_all.py)."""
    step = getattr(handle, "advance", None)
    if step is not None:
        step()


class Collectives(Communicator):
    """Collectives over one data-parallel process group (None: the default group)."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> CommHandle:
        """``output`` = this rank's shard of the group-wide sum of ``input`` (``input.numel() == W * output.numel()``).

        ``input`` may be overwritten. ``output`` may be a view of this rank's shard of ``input``.
        """
        return self.reduce_scatter_tensor(output, input, async_op=async_op, input_is_scratch=True)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False, tag: int = 0
    ) -> CommHandle:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may be this rank's shard of ``output``
        (``tag``: see ``Communicator.all_gather_into_tensor``)."""
        return self.all_gather_into_tensor(output, input, async_op=async_op, tag=tag)
