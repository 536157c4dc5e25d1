"""``Communicator.all_to_all_single``: the shared-memory kernel and gloo against a reference built from every
rank's input (bit-exact: an all-to-all only moves bytes), sizes that are not multiples of the chunk, with
small slots (many chunks), on 2 and 4 ranks; unequal splits and odd shapes go through gloo."""

from __future__ import annotations

import pytest
import torch

from ds_strategy.comm import Communicator
from tests.harness import run_distributed

SMALL_SLOTS = {"DS_STRATEGY_SHM_SLOT_BYTES": str(64 * 1024)}  # many chunks per call


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _body(rank: int, world: int, sizes: list[int]) -> list[str]:
    shm = Communicator()
    gloo = Communicator(fast_path=False)
    problems = []
    try:
        assert shm.fast_path is not None, "the shared-memory path did not open"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for piece in sizes:
                n = piece * world
                x = _input(rank, n, dtype)
                want = torch.cat([_input(r, n, dtype).view(world, piece)[rank] for r in range(world)])
                for name, comm in (("shm", shm), ("gloo", gloo)):
                    out = torch.full_like(x, float("nan"))
                    comm.all_to_all_single(out, x)
                    if not torch.equal(
                        out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
                    ):
                        problems.append(f"{name} {dtype} piece={piece}: differs")
        # 2-D (dim 0 split, the MoE dispatch shape) and async through shm
        x = _input(rank, world * 6 * 5, torch.float32).view(world * 6, 5)
        out = torch.empty_like(x)
        shm.all_to_all_single(out, x, async_op=True).wait()
        want = torch.cat([_input(r, world * 30, torch.float32).view(world, 6, 5)[rank] for r in range(world)])
        if not torch.equal(out, want):
            problems.append("2-D async shm differs")
        # unequal splits: rank r sends r + 1 + j rows to rank j
        send = [rank + 1 + j for j in range(world)]
        recv = [r + 1 + rank for r in range(world)]
        x = torch.full((sum(send), 3), float(rank))
        out = torch.empty(sum(recv), 3)
        shm.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
        want = torch.cat([torch.full((recv[r], 3), float(r)) for r in range(world)])
        if not torch.equal(out, want):
            problems.append("unequal splits differ")
    finally:
        shm.close()
        gloo.close()
    return problems


@pytest.mark.multiprocess
@pytest.mark.kernels
@pytest.mark.parametrize(
    ("world", "env"), [(2, {}), (2, SMALL_SLOTS), (4, SMALL_SLOTS)], ids=["w2", "w2-small", "w4-small"]
)
def test_all_to_all_matches_reference(cpu_kernels: bool, world: int, env: dict[str, str]) -> None:
    sizes = [0, 1, 7, 1000, 40_000]  # 40k fp32 pieces: several 64 KiB chunks, a ragged last one
    results = run_distributed(_body, world_size=world, args=(sizes,), env=env, timeout=180)
    assert results == [[]] * world


def _errors_body(rank: int, world: int) -> list[str]:
    comm = Communicator(fast_path=False)
    out = []
    for args in ((torch.empty(3), torch.empty(3)), (torch.empty(4), torch.empty(4, dtype=torch.float64))):
        try:
            comm.all_to_all_single(*args)
        except ValueError as e:
            out.append(str(e))
    comm.close()
    return out


@pytest.mark.multiprocess
def test_all_to_all_errors_name_the_fault() -> None:
    msgs = run_distributed(_errors_body, world_size=2)[0]
    assert "input has 3 rows, not divisible by the group size 2; pass input_split_sizes" in msgs[0]
    assert "output is torch.float32 on cpu, input torch.float64" in msgs[1]
