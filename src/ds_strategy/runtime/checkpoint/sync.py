"""Ranks fail together: a step of a save or load runs on every rank, and if it raised anywhere, it raises
everywhere (the failing rank its own error, the others one naming that rank), so no rank hangs in a later
collective and no rank mutates its state while another has rejected the checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..zero import Collectives
from .format import CheckpointError

T = TypeVar("T")


def gather(coll: Collectives, value: Any) -> list[Any]:
    """Every rank's ``value`` (small Python objects), in rank order; also a barrier."""
    if coll.world_size == 1:
        return [value]
    out: list[Any] = [None] * coll.world_size
    dist.all_gather_object(out, value, group=coll.group)
    return out


def agree(coll: Collectives, step: Callable[[], T], what: str) -> T:
    result: T | None = None
    error: BaseException | None = None
    try:
        result = step()
    except Exception as exc:  # re-raised below, after the other ranks have heard of it
        error = exc
    reports = gather(coll, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
    if failed:
        r, msg = failed[0]
        raise CheckpointError(f"{what} failed on rank {r}: {msg}")
    return result  # type: ignore[return-value]  # step() returned: T
