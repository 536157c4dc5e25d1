"""Where stage 3's gathered bucket buffers live on the host: the compiled size-keyed pool, or malloc.

[Note: gathered buckets and host memory]
Stage 3 allocates a full-size buffer for each bucket before its module runs and frees it right after,
twice per step for every bucket. Through glibc's malloc that churn is costly either way: by default glibc
raises its mmap threshold (up to 32 MiB) once such a block is freed, later buckets come from the heap and
freed heap memory stays in the process, so peak RSS barely shows the parameters stage 3 no longer keeps
(measured on the ~25M-parameter GPT, 2 ranks: 42% of the theoretical saving); pinning the thresholds
returns the blocks at once but then every multi-MiB allocation of the process, activations included,
pays fresh page faults (1 MiB: +50% step time; 8 MiB: +15%). So on CPU the buffers come from the host
pool in csrc/memory/host_pool.cpp: buffers keyed by exact size, reused while warm, the pool holding only
the peak number of buckets live at once (bounded by stage3_max_live_parameters plus the prefetch).
``trim()`` gives the cached buffers back (after a full gather such as GatheredParameters over the whole
model, and when the engine is torn down). The pool maps its buffers of 1 MiB and up from the kernel, so
they never move glibc's thresholds. Without the compiled kernels the buffers come from torch's allocator
and the mmap/trim thresholds are pinned at 8 MiB instead (the measured best trade-off then).

The rest of a CPU step (activations, gradients) still goes through malloc, and stage 3's allocation pattern
(buckets gathered and freed between the layers' activations) leaves free chunks inside glibc's heap that it
does not return: measured on the LoRA Llama of benchmarks/bench_lora_lightning.py, the heap's free bytes
grew by ~12 MiB a step (67 to 135 MiB over five steps, stage 2 steady at ~66) with live bytes flat. A trim
of the heap (``trim_heap``: malloc_trim(0)) hands those pages back; the two trims of [Note: the loss's peak]
do it in every step, so the creep cannot outlive a forward. A third trim after each optimizer step (stop
49 to 60) only handed back the backward's freed activations, which the next forward then faulted in again:
on the e2e GPT of benchmarks/bench_e2e.py (2 ranks) the forward took 914-979 ms with it and 771-850
without (median of 8 steps), 6% of the step, for 24-40 MiB of the LoRA rank's peak (63M: 724 -> 748 MiB,
162M: 1078 -> 1118; still 101% and 90% of the theoretical saving). So the optimizer step trims nothing.

[Note: the loss's peak]
A step's heap peaks at the loss's backward: every activation is alive and the loss adds its transients (for
a language model, several logits-sized tensors: the log-softmax, its gradient, the logits' gradient). Two
things sat beside that peak without serving it, because the pool and the heap cannot lend each other memory:
the pool's idle buffers (freed at the head, cached for the backward), and the heap's free chunks left by the
forward's temporaries, too small or too scattered for the loss's tensors, which then extend the heap. Then
the backward takes its gathered buffers from the pool while the heap still holds the loss's freed
transients. So when the forward's stage-3 work is over (``give_back_idle``: at the exit of a tiled head whose
next fetch is the last block's backward, else when the backward starts) the pool gives back its idle
buffers and the heap its free pages, and the heap is trimmed once more when the backward first takes a
gathered buffer (``trim_heap_at_next_allocation``: the loss's backward is done by then). Measured on the LoRA Llama of
benchmarks/bench_lora_lightning.py (63M, 2 ranks): the training steps' peak 772-777 MiB -> 717-726, two
trims of ~5 ms a step more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from ds_strategy.ops.builder import load_cpu_kernels

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_PERTURB = -6  # what MALLOC_PERTURB_ sets
_PERTURB_BYTE = 0xA5
THRESHOLD_BYTES = 8 << 20


def pooled(device: torch.device) -> bool:
    """True when gathered buckets on ``device`` come from the host pool."""
    return device.type == "cpu" and load_cpu_kernels()


_TRIM_AT_NEXT_ALLOCATION = [False]  # see [Note: the loss's peak]


def give_back_idle() -> None:
    """The pool's idle buffers and the heap's free pages back to the OS ([Note: the loss's peak])."""
    trim()
    trim_heap()


def trim_heap_at_next_allocation() -> None:
    """Trim the heap when the next gathered buffer is taken on the CPU ([Note: the loss's peak])."""
    _TRIM_AT_NEXT_ALLOCATION[0] = True


def allocate(tensor: torch.Tensor) -> None:
    """Give ``tensor``'s (empty) storage room for all its elements; the contents are undefined."""
    if _TRIM_AT_NEXT_ALLOCATION[0] and tensor.device.type == "cpu":
        _TRIM_AT_NEXT_ALLOCATION[0] = False
        trim_heap()  # the loss's backward has freed its transients: [Note: the loss's peak]
    nbytes = tensor.numel() * tensor.element_size()
    if pooled(tensor.device):
        torch.ops.ds_strategy.host_pool_resize_(tensor, nbytes)
    else:
        tensor.untyped_storage().resize_(nbytes)


def unallocated(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``numel`` elements whose storage holds no bytes yet (``allocate`` gives it room)."""
    tensor = torch.empty(numel, dtype=dtype, device=device)
    release(tensor)
    return tensor


def release(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s storage bytes (the tensor and its views survive, with no data behind them)."""
    if pooled(tensor.device):
        torch.ops.ds_strategy.host_pool_resize_(tensor, 0)
    else:
        tensor.untyped_storage().resize_(0)


def trim() -> int:
    """Free the pool's cached buffers (those in use stay); bytes freed."""
    return int(torch.ops.ds_strategy.host_pool_trim()) if load_cpu_kernels() else 0


def pool_stats() -> tuple[int, int]:
    """(bytes in use, bytes cached) of the host pool; zeros without the compiled kernels."""
    if not load_cpu_kernels():
        return 0, 0
    in_use, cached = torch.ops.ds_strategy.host_pool_stats()
    return int(in_use), int(cached)


@cache
def return_freed_memory_to_os() -> bool:
    """Without the pool: pin glibc's mmap/trim thresholds at 8 MiB for this process, once; False where that
    does not apply (not glibc, or the user chose them through MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_)."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False  # not glibc (musl, macOS): their allocators return large blocks by themselves
    return bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))


@contextmanager
def committed_allocations() -> Iterator[None]:
    """While the block runs, glibc writes every allocation (``mallopt(M_PERTURB)``, what ``MALLOC_PERTURB_``
    sets at start-up), so the resident set counts every byte allocated, as a device would hold it; the
    autotuner's CPU trials measure under it. Nothing happens without glibc."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        yield
        return
    mallopt(_M_PERTURB, _PERTURB_BYTE)
    try:
        yield
    finally:
        mallopt(_M_PERTURB, 0)


@cache
def _glibc(name: str) -> Any:
    """glibc's function ``name`` through ctypes, or None where the C library is not glibc."""
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the free pages inside glibc's heap back to the OS (``malloc_trim(0)``): NVMe offload calls it
    where a phase has freed many mid-sized blocks (see [Note: host memory under NVMe offload])."""
    fn = _glibc("malloc_trim")
    if fn is not None:
        fn(0)
