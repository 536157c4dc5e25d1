"""Shared-memory collectives against gloo and an exact fp32-accumulated reference, on 2 and 4 ranks.

Reference: every rank regenerates every rank's input from a seed, sums them in rank order in fp32, divides
by W for "avg" and rounds once to the dtype; the kernel does exactly that (slot_reduce.h), so it must match
bit for bit for every dtype. Against gloo (fp32 only, gloo has no avg: its sum / W): with 2 ranks a + b is
the same in any order, so also bit for bit; with 4 ranks gloo adds in another order, and the difference
is bounded by the rounding of a 4-term sum, 2 * (W - 1) * eps/2 * sum |x_r| per element.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_strategy.comm.shm import ShmCommunicator
from tests.gil import spinner_ticks_during
from tests.harness import DistributedTestError, run_distributed

pytestmark = [pytest.mark.kernels, pytest.mark.multiprocess]

SIZES = (1, 3, 15, 17, 4097, 1_000_003)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHM_PREFIX = "ds_strategy_shm."
SMALL_SLOTS = {"DS_STRATEGY_SHM_SLOT_BYTES": str(64 * 1024)}  # many chunks, uneven slices


def _our_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}


def _input(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn(n, generator=gen).to(dtype)


def _reference_sum(world: int, n: int, dtype: torch.dtype, seed: int, avg: bool) -> torch.Tensor:
    acc = _input(0, n, dtype, seed).float()
    for r in range(1, world):
        acc = acc + _input(r, n, dtype, seed).float()
    if avg:
        acc = acc / world
    return acc.to(dtype)


def _abs_sum(world: int, n: int, seed: int) -> torch.Tensor:
    return sum((_input(r, n, torch.float32, seed).abs() for r in range(world)), torch.zeros(n))


def _compare(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got, want):
        return None
    diff = (got.float() - want.float()).abs()
    return f"{what}: {int((diff > 0).sum())} of {got.numel()} differ, max {diff.max().item():.3g}"


def _run_case(comm: ShmCommunicator, rank: int, world: int, case: tuple[str, int, str, str], seed: int) -> list[str]:
    kind, n, dtype_name, op = case
    dtype = DTYPES[dtype_name]
    what = f"{kind} n={n} {dtype_name} {op} W={world}"
    problems: list[str] = []
    avg = op == "avg"
    if kind == "all_reduce":
        t = _input(rank, n, dtype, seed)
        comm.all_reduce(t, op)
        got, want = t, _reference_sum(world, n, dtype, seed, avg)
    elif kind == "reduce_scatter":
        out = torch.full((n,), float("nan"), dtype=dtype)
        comm.reduce_scatter(out, _input(rank, world * n, dtype, seed), op)
        got, want = out, _reference_sum(world, world * n, dtype, seed, avg)[rank * n : (rank + 1) * n]
    else:
        out = torch.full((world * n,), float("nan"), dtype=dtype)
        comm.all_gather(out, _input(rank, n, dtype, seed))
        got, want = out, torch.cat([_input(r, n, dtype, seed) for r in range(world)])
    if (msg := _compare(what + " vs fp32 reference", got, want)) is not None:
        problems.append(msg)
    if dtype == torch.float32:
        problems += _against_gloo(kind, rank, world, n, seed, avg, got, what)
    return problems


def _against_gloo(
    kind: str, rank: int, world: int, n: int, seed: int, avg: bool, got: torch.Tensor, what: str
) -> list[str]:
    if kind == "all_reduce":
        ref = _input(rank, n, torch.float32, seed)
        dist.all_reduce(ref)
    elif kind == "reduce_scatter":
        ref = torch.empty(n)
        dist.reduce_scatter_tensor(ref, _input(rank, world * n, torch.float32, seed))
    else:
        ref = torch.empty(world * n)
        dist.all_gather_into_tensor(ref, _input(rank, n, torch.float32, seed))
    if kind != "all_gather" and avg:
        ref = ref / world
    if world == 2 or kind == "all_gather":
        msg = _compare(what + " vs gloo", got, ref)
        return [msg] if msg else []
    total = n * world if kind == "reduce_scatter" else n
    bound = _abs_sum(world, total, seed) * (world - 1) * torch.finfo(torch.float32).eps
    if kind == "reduce_scatter":
        bound = bound[rank * n : (rank + 1) * n]
    if avg:
        bound = bound / world
    bad = (got - ref).abs() > bound
    return [f"{what} vs gloo: {int(bad.sum())} elements beyond the summation-order bound"] if bad.any() else []


def _cases_body(rank: int, world: int, cases: list[tuple[str, int, str, str]]) -> list[str]:
    comm = ShmCommunicator.create(timeout=60)
    assert comm is not None, "all ranks run on this host: expected a communicator"
    problems: list[str] = []
    try:
        for i, case in enumerate(cases):
            problems += _run_case(comm, rank, world, case, seed=i)
    finally:
        comm.close()
    return problems


def _cases(sizes: tuple[int, ...]) -> list[tuple[str, int, str, str]]:
    cases = []
    for n in sizes:
        for dtype in DTYPES:
            for op in ("sum", "avg"):
                cases.append(("all_reduce", n, dtype, op))
                cases.append(("reduce_scatter", n, dtype, op))
            cases.append(("all_gather", n, dtype, "sum"))
    return cases


@pytest.mark.parametrize(
    ("world", "env"), [(2, {}), (2, SMALL_SLOTS), (4, SMALL_SLOTS)], ids=["w2", "w2-small-slots", "w4-small-slots"]
)
def test_matches_gloo_and_reference(cpu_kernels: bool, world: int, env: dict[str, str]) -> None:
    results = run_distributed(_cases_body, world_size=world, args=(_cases(SIZES),), env=env, timeout=300)
    assert results == [[]] * world, "\n".join(p for rank_problems in results for p in rank_problems)


def _big_body(rank: int, world: int, n: int) -> tuple[bool, float]:
    comm = ShmCommunicator.create(timeout=120)
    assert comm is not None
    x = torch.arange(n, dtype=torch.float32).mul_(1e-3 * (rank + 1)).sin_()
    ref = x.clone()
    dist.all_reduce(ref)
    start = time.perf_counter()
    comm.all_reduce(x)
    seconds = time.perf_counter() - start
    comm.close()
    return torch.equal(x, ref), seconds


@pytest.mark.slow
def test_largest_all_reduce_matches_gloo(cpu_kernels: bool) -> None:
    # 2**26 fp32 = 256 MiB per rank, many chunks: bit-identical to gloo (2 ranks: a + b in any order).
    results = run_distributed(_big_body, world_size=2, args=(2**26,), timeout=300)
    assert all(same for same, _ in results), results


# -- segment hygiene ------------------------------------------------------------------------------------


def _hygiene_body(rank: int, world: int) -> dict[str, Any]:
    comm = ShmCommunicator.create(timeout=30)
    assert comm is not None
    info = comm.segment_info()
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX))
    t = torch.ones(10)
    comm.all_reduce(t)
    comm.close()
    closed_error = ""
    try:
        comm.all_reduce(t)
    except ValueError as err:
        closed_error = str(err)
    return {"info": info, "left": left, "value": t[0].item(), "closed_error": closed_error, "uid": os.geteuid()}


def test_segment_is_owner_only_and_unlinked_after_create(cpu_kernels: bool) -> None:
    before = _our_segments()
    results = run_distributed(_hygiene_body, world_size=2)
    for r in results:
        assert r["info"]["mode"] == 0o600, oct(r["info"]["mode"])
        assert r["info"]["uid"] == r["uid"]
        assert r["left"] == [], f"segment names left in /dev/shm right after create: {r['left']}"
        assert r["value"] == 2.0
        assert "closed" in r["closed_error"]
    assert len({r["info"]["name"] for r in results}) == 1
    name = results[0]["info"]["name"]
    assert name.startswith("/" + SHM_PREFIX) and len(name) == len(SHM_PREFIX) + 1 + 32  # 128 random bits
    assert _our_segments() <= before


# -- errors ---------------------------------------------------------------------------------------------


def _expect(exc: type[Exception], fn: Any, *args: Any) -> str:
    try:
        fn(*args)
    except exc as err:
        return str(err)
    raise AssertionError(f"{fn.__name__}{args!r} did not raise {exc.__name__}")


def _errors_body(rank: int, world: int) -> dict[str, str]:
    comm = ShmCommunicator.create(timeout=30)
    assert comm is not None
    m = {
        "noncontig": _expect(ValueError, comm.all_reduce, torch.ones(4, 4).t()),
        "dtype": _expect(ValueError, comm.all_reduce, torch.ones(4, dtype=torch.float64)),
        "op": _expect(ValueError, comm.all_reduce, torch.ones(4), "max"),
        "rs_size": _expect(ValueError, comm.reduce_scatter, torch.ones(3), torch.ones(7)),
        "ag_size": _expect(ValueError, comm.all_gather, torch.ones(7), torch.ones(3)),
        "mixed": _expect(ValueError, comm.all_gather, torch.ones(6), torch.ones(3, dtype=torch.bfloat16)),
        # The C++ boundary checks on its own too (a second line behind the Python checks).
        "cpp_noncontig": _expect(RuntimeError, comm._handle.all_reduce, torch.ones(4, 4).t(), "sum"),
        "cpp_overlap": _expect(RuntimeError, comm._handle.all_gather, (b := torch.ones(8))[1:5], b[0:2]),
    }
    assert not comm.supports(torch.ones(4, 4).t()) and not comm.supports(torch.ones(2), torch.ones(2).half())
    assert comm.supports(torch.ones(2).bfloat16(), torch.ones(3).bfloat16())
    # Ranks disagreeing on the size: every rank raises, listing each rank's call; the communicator survives.
    m["mismatch"] = _expect(RuntimeError, comm.all_reduce, torch.ones(10 + rank))
    t = torch.ones(5)
    comm.all_reduce(t)
    m["after"] = str(t[0].item())
    # Tagged all_gather: equal tags gather; different tags raise on every rank, and peer_tags() tells them.
    g = torch.zeros(4)
    comm.all_gather(g, torch.full((2,), float(rank + 1)), tag=7)
    m["tagged"] = str(g.tolist())
    m["tag_mismatch"] = _expect(RuntimeError, comm.all_gather, torch.zeros(4), torch.ones(2), 100 + rank)
    m["peer_tags"] = str(comm.peer_tags())
    # In place: reduce_scatter into this rank's shard of the input, all_gather from this rank's shard.
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    comm.reduce_scatter(x[rank * 2 : rank * 2 + 2], x)
    y = torch.zeros(4)
    y[rank * 2 : rank * 2 + 2] = rank + 1
    comm.all_gather(y, y[rank * 2 : rank * 2 + 2])
    m["inplace"] = f"{x[rank * 2 : rank * 2 + 2].tolist()} {y.tolist()}"
    comm.close()
    return m


def test_clear_errors(cpu_kernels: bool) -> None:
    results = run_distributed(_errors_body, world_size=2)
    m = results[0]
    assert "not contiguous" in m["noncontig"] and "tensor" in m["noncontig"]
    assert "float64" in m["dtype"] and "float32, bfloat16, float16" in m["dtype"]
    assert "'max'" in m["op"]
    assert "input has 7 elements; expected world_size (2) x output.numel() (3) = 6" in m["rs_size"]
    assert "output has 7 elements" in m["ag_size"]
    assert "input has dtype torch.bfloat16" in m["mixed"]
    assert "not contiguous" in m["cpp_noncontig"] and "overlaps" in m["cpp_overlap"]
    for r in results:
        assert "rank 0: all_reduce float32 numel=10" in r["mismatch"]
        assert "rank 1: all_reduce float32 numel=11" in r["mismatch"]
        assert r["after"] == "2.0"
        assert r["tagged"] == "[1.0, 1.0, 2.0, 2.0]"
        assert "rank 0: all_gather float32 numel=2 tag=100" in r["tag_mismatch"], r["tag_mismatch"]
        assert "rank 1: all_gather float32 numel=2 tag=101" in r["tag_mismatch"], r["tag_mismatch"]
        assert r["peer_tags"] == "[100, 101]"
    assert results[0]["inplace"] == "[10.0, 12.0] [1.0, 1.0, 2.0, 2.0]"
    assert results[1]["inplace"] == "[14.0, 16.0] [1.0, 1.0, 2.0, 2.0]"


# -- a rank that never arrives --------------------------------------------------------------------------


def _late_body(rank: int, world: int) -> tuple[str, float]:
    comm = ShmCommunicator.create(timeout=1.0)
    assert comm is not None
    message, seconds = "", 0.0
    if rank == 0:
        start = time.monotonic()
        message = _expect(RuntimeError, comm.all_reduce, torch.ones(1000))
        seconds = time.monotonic() - start
        message += " | next: " + _expect(RuntimeError, comm.all_reduce, torch.ones(3))
    dist.barrier()  # rank 1 stays out of the collective until rank 0 gave up
    comm.close()
    return message, seconds


@pytest.mark.serial
def test_missing_rank_times_out_named(cpu_kernels: bool) -> None:
    (message, seconds), _ = run_distributed(_late_body, world_size=2)
    assert "all_reduce: rank 1 did not arrive within the 1 s timeout" in message, message
    assert 1.0 <= seconds < 3.0, seconds
    assert "timed out earlier" in message  # the broken communicator refuses further work


def _killed_body(rank: int, world: int) -> None:
    comm = ShmCommunicator.create(timeout=3.0)
    assert comm is not None
    t = torch.ones(1 << 20)
    if rank == 1:  # dies from a side thread while its main thread is inside the collectives
        threading.Timer(0.3, os._exit, args=(17,)).start()
    start = time.monotonic()
    try:
        while True:
            comm.all_reduce(t, "avg")
    except RuntimeError as err:
        raise AssertionError(f"SURVIVOR after {time.monotonic() - start:.2f}s: {err}") from None


@pytest.mark.serial
def test_killed_peer_is_named_within_the_timeout(cpu_kernels: bool) -> None:
    before = _our_segments()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_killed_body, world_size=2, timeout=60)
    text = str(info.value)
    assert "rank 1 died with exit code 17" in text, text
    found = re.search(r"SURVIVOR after ([0-9.]+)s: (.*)", text)
    assert found is not None, text
    seconds, message = float(found.group(1)), found.group(2)
    assert seconds < 0.3 + 3.0 + 1.0, message  # kill time + timeout + slack
    assert re.search(r"shm all_reduce: rank 1 (\(pid \d+\) has exited|did not arrive)", message), message
    print(f"survivor raised {seconds:.2f}s after start: {message}")
    assert _our_segments() <= before  # the dead rank left nothing behind


# -- GIL ------------------------------------------------------------------------------------------------


def _gil_body(rank: int, world: int) -> tuple[int, float, float]:
    comm = ShmCommunicator.create(timeout=60)
    assert comm is not None
    big = torch.ones(1 << 24)
    try:
        return spinner_ticks_during(lambda: [comm.all_reduce(big) for _ in range(3)])
    finally:
        comm.close()


@pytest.mark.serial
def test_collective_releases_the_gil(cpu_kernels: bool) -> None:
    # With the GIL held inside the op the spinner would stop for the whole call. Two ranks and two spinners
    # share 2 cores here, so the bar is a tenth of the free-running rate, far above zero.
    for during, rate, elapsed in run_distributed(_gil_body, world_size=2):
        assert during > 0.1 * rate * elapsed, f"spinner ran {during} ticks in {elapsed:.3f}s (rate {rate:.0f}/s)"
