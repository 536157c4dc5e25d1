"""``ds_strategy.zero.Init`` on 2 ranks: peak memory while building stays well below the model's size, the
values equal a plain build with the same seed, GatheredParameters edits partitioned parameters before any
engine exists, and a stage-3 engine built from the partitioned model trains exactly like one built from
the plain model.

Peak memory is the process's peak resident set (``VmHWM``), reset through ``/proc/self/clear_refs``
right before each build, minus the resident set at that moment: everything the build allocates counts,
not only what ds_strategy tracks. glibc's malloc is pinned to mmap allocations of 1 MiB and up (and to
trimming the heap above 1 MiB): otherwise its dynamic thresholds keep freed multi-MiB blocks resident, and
the peak resident set would measure the allocator's caching and fragmentation instead of live memory.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

D, BLOCKS, LEAVES = 1024, 6, 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Big(nn.Module):
    """~42M bytes of fp32 parameters: blocks with child layers, plus a Sequential of leaf Linears built in a
    list comprehension (each is complete before any parent holds it) and a root-level parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(D) for _ in range(BLOCKS)])
        self.leaves = nn.Sequential(*[nn.Linear(D, D) for _ in range(LEAVES)])
        self.scale = nn.Parameter(torch.rand(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return (self.leaves(x) * self.scale).square().mean()


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        status = f.read()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


def _peak_build_bytes(build: Any) -> tuple[Any, int]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _kib("VmRSS")
    model = build()
    return model, (_kib("VmHWM") - before) * 1024


def _pin_malloc_thresholds() -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixed: no dynamic growth)
    libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD


def _init_run(rank: int, world: int) -> dict[str, Any]:
    import ds_strategy.runtime as rt
    from ds_strategy.zero import GatheredParameters, Init

    def sharded() -> Big:
        torch.manual_seed(0)
        with Init():
            return Big()

    def plain() -> Big:
        torch.manual_seed(0)
        return Big()

    _pin_malloc_thresholds()
    sharded()  # warm-up: first-use allocations of the collectives are not the model's
    model, init_peak = _peak_build_bytes(sharded)
    reference, plain_peak = _peak_build_bytes(plain)
    full = sum(p.numel() * 4 for p in reference.parameters())
    at_rest = sum(p.numel() for p in model.parameters())
    with GatheredParameters(list(model.parameters())):
        equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    # An edit before any engine exists (re-initialisation): rank 0's values win on every rank.
    with GatheredParameters(model.scale, modifier_rank=0), torch.no_grad():
        model.scale.fill_(0.5 if rank == 0 else 9.0)
    with torch.no_grad():
        reference.scale.fill_(0.5)

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 2000},
    }
    losses = {}
    weights = {}
    for name, m in (("init", model), ("plain", reference)):
        engine, *_ = rt.initialize(model=m, config=cfg)
        x = torch.randn(2, D, generator=torch.Generator().manual_seed(3))
        out = []
        for _ in range(2):
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        losses[name] = out
        with GatheredParameters(list(m.parameters())):
            weights[name] = [p.detach().clone() for p in m.parameters()]
        engine.destroy()
    return {
        "init_peak": init_peak,
        "plain_peak": plain_peak,
        "full": full,
        "at_rest": at_rest,
        "equal": equal,
        "losses": losses,
        "same_weights": all(torch.equal(a, b) for a, b in zip(weights["init"], weights["plain"], strict=True)),
    }


@pytest.mark.multiprocess
def test_zero_init_builds_partitioned_below_full_size_and_trains_like_a_plain_build() -> None:
    for rank, r in enumerate(run_distributed(_init_run, world_size=2, timeout=180)):
        full = r["full"]
        # The plain build holds the whole model; under Init a rank holds its half plus about one layer.
        assert r["plain_peak"] >= 0.95 * full, r
        assert r["init_peak"] <= 0.7 * full, (
            f"rank {rank}: peak {r['init_peak'] / 2**20:.1f} MiB, model {full / 2**20:.1f} MiB"
        )
        assert r["at_rest"] == 0, "every parameter is a placeholder after the build"
        assert r["equal"], "zero.Init values must equal a plain build with the same seed"
        assert r["losses"]["init"] == r["losses"]["plain"], r["losses"]
        assert r["same_weights"]
