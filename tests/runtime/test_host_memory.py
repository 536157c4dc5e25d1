"""Stage 3's host pool for gathered buckets (csrc/memory/host_pool.cpp via runtime/host_memory.py)."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.runtime import host_memory


@pytest.fixture
def pool(cpu_kernels: bool) -> None:
    if not host_memory.pooled(torch.device("cpu")):
        pytest.skip("the host pool needs the compiled CPU kernels")
    host_memory.trim()


def test_views_see_the_refilled_buffer_and_sizes_are_reused(pool: None) -> None:
    full = torch.empty(1024)
    saved = full.view(32, 32).t()  # what autograd keeps of a weight: a view into the same storage
    host_memory.release(full)
    assert full.untyped_storage().nbytes() == 0
    host_memory.allocate(full)
    full.copy_(torch.arange(1024.0))
    assert torch.equal(saved, torch.arange(1024.0).view(32, 32).t())  # the view reads the pooled buffer
    first = full.data_ptr()
    host_memory.release(full)
    assert host_memory.pool_stats() == (0, 4096)  # back in the pool, cached
    host_memory.allocate(full)
    assert full.data_ptr() == first and host_memory.pool_stats() == (4096, 0)  # reused, not reallocated
    other = torch.empty(1024)
    host_memory.release(other)
    host_memory.allocate(other)  # a second live buffer of the same size is a new one
    assert other.data_ptr() != first and host_memory.pool_stats() == (8192, 0)
    del other  # the storage's destruction hands its buffer back too
    assert host_memory.pool_stats() == (4096, 4096)
    full.untyped_storage().resize_(0)  # so does a plain storage resize
    assert host_memory.pool_stats() == (0, 8192)
    assert host_memory.trim() == 8192 and host_memory.pool_stats() == (0, 0)


def test_allocate_refuses_a_storage_that_still_holds_bytes(pool: None) -> None:
    with pytest.raises(RuntimeError, match="resize it to 0 first"):
        host_memory.allocate(torch.empty(8))


def test_without_kernels_storage_is_resized_by_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "pooled", lambda device: False)
    t = torch.empty(16)
    host_memory.release(t)
    assert t.untyped_storage().nbytes() == 0
    host_memory.allocate(t)
    assert t.untyped_storage().nbytes() == 64
