"""torch's fake process group in the pytest process: one process as rank ``rank`` of ``world_size``, no peers.

    with fake_group(monkeypatch, world_size=4):
        engine, *_ = ds_strategy.initialize(...)      # runs the real code at world size 4, in this process

No worker processes: the fake group answers every collective at once without moving data (see [Note: the
fake process group] in src/ds_strategy/comm/distributed.py). The group is destroyed at the end of the block,
whatever happened inside it; ``monkeypatch`` puts back the ``sys.excepthook`` that ``init_process_group``
wraps (tests/leak_police.py checks both).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@contextlib.contextmanager
def fake_group(monkeypatch: pytest.MonkeyPatch, *, world_size: int, rank: int = 0) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already initialised in this process"
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
