"""Communicator against plain torch.distributed over gloo (the reference): every collective, dtype and op,
sizes from 1 element to a few MB (odd ones included), world sizes 2 and 4, async handles, coalescing,
explicit subgroups, and the routing to the shared-memory fast path (through an injected test double)."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from ds_strategy.comm import CommsLogger, Communicator, reduce_op_name
from tests.harness import run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Random-data tolerances: the emulated and native collectives may add in different orders.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 0.07, torch.float16: 0.01}
_native_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_native_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _data(rank: int, numel: int, dtype: torch.dtype, integers: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank * 7919 + numel)
    # Small integers are exact in every dtype and any summation order: results must match bit for bit.
    x = torch.randint(-8, 9, (numel,), generator=g).float() if integers else torch.randn(numel, generator=g)
    return x.to(dtype)


def _check(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(got, want), f"{what}: max diff {(got.float() - want.float()).abs().max()}"
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=ATOL[got.dtype], msg=lambda m: f"{what}: {m}")


def _parity_body(rank: int, world: int, sizes: list[int], fast_path: bool | None) -> list[str]:
    comm = Communicator(fast_path=fast_path)
    checked = []
    for dtype in DTYPES:
        for numel in sizes:
            for integers in (True, False):
                big = _data(rank, numel * world, dtype, integers)
                for op in ("sum", "avg"):
                    what = f"{dtype} n={numel} {op} {'int' if integers else 'randn'}"
                    # all_reduce
                    got, want = big[:numel].clone(), big[:numel].clone()
                    comm.all_reduce(got, op)
                    dist.all_reduce(want)
                    if op == "avg":
                        want.div_(world)
                    _check(got, want, integers, f"all_reduce {what}")
                    # reduce_scatter (input left unchanged)
                    inp = big.clone()
                    got = torch.full((numel,), float("nan"), dtype=dtype)
                    comm.reduce_scatter_tensor(got, inp, op)
                    assert torch.equal(inp, big), f"reduce_scatter changed its input ({what})"
                    want = torch.empty(numel, dtype=dtype)
                    _native_rs(want, big.clone())
                    if op == "avg":
                        want.div_(world)
                    _check(got, want, integers, f"reduce_scatter {what}")
                # all_gather is bit-exact on any data
                shard = big[:numel].clone()
                got = torch.full((numel * world,), float("nan"), dtype=dtype)
                comm.all_gather_into_tensor(got, shard)
                want = torch.empty(numel * world, dtype=dtype)
                _native_ag(want, shard)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"all_gather {dtype} n={numel}"
                checked.append(f"{dtype}/{numel}/{integers}")
    comm.close()
    return checked


@pytest.mark.multiprocess
@pytest.mark.parametrize("fast_path", [None, False], ids=["auto", "torch-only"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_gloo(world_size: int, fast_path: bool | None) -> None:
    sizes = [1, 3, 4097, 65537]
    results = run_distributed(_parity_body, world_size=world_size, args=(sizes, fast_path))
    assert len(results[0]) == len(DTYPES) * len(sizes) * 2


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_gloo_at_a_few_megabytes(world_size: int) -> None:
    # 1M + 1 elements: 4 MB fp32 per shard, odd so no SIMD width divides it.
    run_distributed(_parity_body, world_size=world_size, args=([(1 << 20) + 1], None))


def _ops_body(rank: int, world: int) -> None:
    comm = Communicator()
    for op in ("max", "min", "product", dist.ReduceOp.MAX, "SUM", "mean"):
        x = _data(rank, 33, torch.float32, True)
        want = x.clone()
        name = reduce_op_name(op)
        torch_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}.get(
            name, dist.ReduceOp.SUM
        )
        dist.all_reduce(want, op=torch_op)
        if name == "avg":
            want.div_(world)
        comm.all_reduce(x, op)
        assert torch.equal(x, want), op
    # integer tensors: sum and max work, avg is refused with a clear message
    i = torch.arange(5, dtype=torch.int64) * (rank + 1)
    comm.all_reduce(i, "sum")
    assert torch.equal(i, torch.arange(5) * sum(range(1, world + 1)))
    with pytest.raises(ValueError, match=r"avg of a torch\.int64"):
        comm.all_reduce(i, "avg")
    with pytest.raises(ValueError, match="unknown reduce op 'median'"):
        comm.all_reduce(i, "median")
    # reduce_scatter with max (the emulation reduces with the same op)
    big = _data(rank, 4 * world, torch.float32, True)
    out = torch.empty(4)
    comm.reduce_scatter_tensor(out, big, "max")
    want = torch.empty(4)
    _native_rs(want, big.clone(), op=dist.ReduceOp.MAX)
    assert torch.equal(out, want)
    # broadcast from every source, and a barrier
    for src in range(world):
        t = torch.full((7,), float(rank))
        comm.broadcast(t, src=src)
        assert torch.equal(t, torch.full((7,), float(src)))
    comm.barrier()
    with pytest.raises(ValueError, match=f"src={world} is not a rank"):
        comm.broadcast(torch.ones(1), src=world)
    # shape errors name the sizes
    with pytest.raises(ValueError, match=f"expected world size {world} x shard 3"):
        comm.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world + 1))
    with pytest.raises(ValueError, match="buffers differ"):
        comm.all_gather_into_tensor(torch.empty(2 * world), torch.empty(2, dtype=torch.float16))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_ops_broadcast_barrier_and_errors(world_size: int) -> None:
    run_distributed(_ops_body, world_size=world_size)


def _emulation_body(rank: int, world: int) -> list[str]:
    logger = CommsLogger()
    emulated, native = (
        Communicator(fast_path=False, logger=logger),
        Communicator(fast_path=False, emulate_gloo=False, logger=logger),
    )
    # Special values survive the integer-sum all_gather bit for bit: -0.0, inf, NaN payloads.
    shard = torch.tensor([-0.0, float("inf"), float("nan"), 1e-45, -3.5], dtype=torch.float32) * (rank + 1)
    for comm in (emulated, native):
        out = torch.empty(5 * world)
        comm.all_gather_into_tensor(out, shard)
        want = torch.empty(5 * world)
        _native_ag(want, shard)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    # input_is_scratch: the emulation may reduce in place, and output may be this rank's view of input
    big = _data(rank, 6 * world, torch.bfloat16, True)
    want = torch.empty(6, dtype=torch.bfloat16)
    _native_rs(want, big.clone())
    scratch = big.clone()
    mine = scratch.view(world, -1)[rank]
    emulated.reduce_scatter_tensor(mine, scratch, input_is_scratch=True)
    assert torch.equal(mine, want)
    # all_gather with input already in place as this rank's shard of output
    out = torch.zeros(6 * world, dtype=torch.bfloat16)
    out.view(world, -1)[rank].copy_(big[:6])
    emulated.all_gather_into_tensor(out, out.view(world, -1)[rank])
    want_ag = torch.empty(6 * world, dtype=torch.bfloat16)
    _native_ag(want_ag, big[:6].clone())
    assert torch.equal(out, want_ag)
    return sorted({row.path for row in logger.summary()})


@pytest.mark.multiprocess
def test_gloo_emulation_is_bit_exact_and_labelled() -> None:
    paths = run_distributed(_emulation_body, world_size=2)
    assert paths[0] == ["gloo", "gloo-ar"]


def _async_body(rank: int, world: int) -> None:
    comm = Communicator()
    xs = [torch.full((1000 + i,), float(rank + i)) for i in range(4)]
    handles = [comm.all_reduce(x, "avg", async_op=True) for x in xs]
    big = torch.arange(8 * world, dtype=torch.float32) + rank
    shard = torch.empty(8)
    h_rs = comm.reduce_scatter_tensor(shard, big, async_op=True)
    gathered = torch.empty(3 * world, dtype=torch.float16)
    h_ag = comm.all_gather_into_tensor(gathered, torch.full((3,), float(rank), dtype=torch.float16), async_op=True)
    h_b = comm.broadcast(bcast := torch.full((5,), float(rank)), src=world - 1, async_op=True)
    h_bar = comm.barrier(async_op=True)
    for h in reversed([*handles, h_rs, h_ag, h_b, h_bar]):
        h.wait()
        h.wait()  # idempotent
        assert h.is_completed()
    mean_rank = sum(range(world)) / world
    for i, x in enumerate(xs):
        assert torch.equal(x, torch.full_like(x, mean_rank + i))
    base = torch.arange(8 * world, dtype=torch.float32).view(world, -1)[rank]
    assert torch.equal(shard, base * world + sum(range(world)))
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float16).repeat_interleave(3))
    assert torch.equal(bcast, torch.full((5,), float(world - 1)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_async_handles(world_size: int) -> None:
    run_distributed(_async_body, world_size=world_size)


def _coalesced_body(rank: int, world: int) -> dict[str, int]:
    logger = CommsLogger()
    comm = Communicator(logger=logger)
    g = torch.Generator().manual_seed(rank)
    tensors = [
        torch.randint(-5, 5, (3,), generator=g).float(),
        torch.randint(-5, 5, (4, 3), generator=g).float().t(),  # non-contiguous: reduced and copied back
        torch.randint(-5, 5, (), generator=g).float(),  # 0-d
        torch.randint(-5, 5, (17,), generator=g).to(torch.bfloat16),
        torch.randint(-5, 5, (5,), generator=g),  # int64
        torch.randint(-5, 5, (2, 2), generator=g).to(torch.float16),
    ]
    wants = [t.clone() for t in tensors]
    for w in wants:
        dist.all_reduce(w)
    ptrs = [t.data_ptr() for t in tensors]
    comm.all_reduce_coalesced(tensors)
    for t, w, p in zip(tensors, wants, ptrs, strict=True):
        assert t.data_ptr() == p and t.shape == w.shape and torch.equal(t, w)
    # async, avg, floats only
    floats = [torch.full((n,), float(rank)) for n in (1, 2, 3)]
    h = comm.all_reduce_coalesced(floats, "avg", async_op=True)
    h.wait()
    assert all(torch.equal(f, torch.full_like(f, sum(range(world)) / world)) for f in floats)
    # broadcast_coalesced from the last rank
    items = [torch.full((4,), float(rank)), torch.full((2, 2), float(rank), dtype=torch.bfloat16)]
    comm.broadcast_coalesced(items, src=world - 1)
    assert all(torch.equal(t, torch.full_like(t, float(world - 1))) for t in items)
    counts: dict[str, int] = {}
    for row in logger.summary():  # rows per (op, path): shm and gloo buckets are counted apart
        counts[row.op] = counts.get(row.op, 0) + row.count
    return counts


@pytest.mark.multiprocess
def test_coalescing_one_collective_per_dtype() -> None:
    counts = run_distributed(_coalesced_body, world_size=2)[0]
    # fp32 / bf16 / int64 / fp16 buckets, then one fp32 bucket; broadcast: fp32 + bf16
    assert counts == {"all_reduce_coalesced": 5, "broadcast": 2}


def _subgroup_body(rank: int, world: int) -> list[Any]:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    evens = dist.new_group([0, 2])
    mine = pairs[rank // 2]
    out: list[Any] = []
    comm = Communicator(mine)
    assert (comm.rank, comm.world_size) == (rank % 2, 2)
    x = torch.tensor([float(rank)])
    comm.all_reduce(x)
    out.append(x.item())
    b = torch.tensor([float(rank)])
    comm.broadcast(b, src=1)  # group rank 1: global 1 or 3
    out.append(b.item())
    gathered = torch.empty(2)
    comm.all_gather_into_tensor(gathered, torch.tensor([float(rank)]))
    out.append(gathered.tolist())
    shard = torch.empty(1)
    comm.reduce_scatter_tensor(shard, torch.tensor([1.0, 10.0]) * (rank + 1), "avg")
    out.append(shard.item())
    if rank % 2 == 0:
        even = Communicator(evens)
        y = torch.tensor([float(rank)])
        even.all_reduce(y)
        out.append(y.item())
    else:
        with pytest.raises(ValueError, match="not a member"):
            Communicator(evens)
    return out


@pytest.mark.multiprocess
def test_explicit_subgroups() -> None:
    results = run_distributed(_subgroup_body, world_size=4)
    assert results[0] == [1.0, 1.0, [0.0, 1.0], (1 + 2) / 2, 2.0]
    assert results[1] == [1.0, 1.0, [0.0, 1.0], (10 + 20) / 2]
    assert results[2] == [5.0, 3.0, [2.0, 3.0], (3 + 4) / 2, 2.0]
    assert results[3] == [5.0, 3.0, [2.0, 3.0], (30 + 40) / 2]


# ---- routing into the fast path ----------------------------------------------------------------------------


class FakeShm:
    """A ShmCommunicator double: correct results (through torch.distributed), every call recorded."""

    instances: ClassVar[list[FakeShm]] = []

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.calls: list[tuple[str, str, torch.dtype]] = []
        self.closed = False

    @staticmethod
    def create(group: dist.ProcessGroup | None = None, *, timeout: float | None = None) -> FakeShm:
        fake = FakeShm(group)
        FakeShm.instances.append(fake)
        return fake

    def supports(self, *tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype in DTYPES for t in tensors)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        self.calls.append(("all_reduce", op, tensor.dtype))
        dist.all_reduce(tensor, group=self.group)
        if op == "avg":
            tensor.div_(self.world)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum") -> None:
        self.calls.append(("reduce_scatter", op, output.dtype))
        _native_rs(output, input.clone(), group=self.group)
        if op == "avg":
            output.div_(self.world)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.calls.append(("all_gather", "-", output.dtype))
        _native_ag(output, input, group=self.group)

    def close(self) -> None:
        self.closed = True


def _routing_body(rank: int, world: int) -> dict[str, Any]:
    fake = FakeShm()
    logger = CommsLogger()
    comm = Communicator(fast_path=fake, logger=logger)
    f32 = torch.full((5,), float(rank))
    comm.all_reduce(f32, "sum")  # shm
    comm.all_reduce(torch.ones(3, dtype=torch.bfloat16), "avg")  # shm
    comm.all_reduce(torch.ones(3), "max")  # gloo: not a fast op
    comm.all_reduce(torch.ones(3, dtype=torch.int32))  # gloo: not a fast dtype
    comm.all_reduce(torch.ones(3, dtype=torch.float64))  # gloo
    h = comm.all_reduce(torch.ones(3, dtype=torch.float16), async_op=True)  # shm, finished already
    assert h.is_completed()
    shard = torch.empty(2, dtype=torch.float16)
    comm.reduce_scatter_tensor(shard, torch.ones(2 * world, dtype=torch.float16), "avg")  # shm
    out = torch.empty(2 * world, dtype=torch.bfloat16)
    comm.all_gather_into_tensor(out, torch.full((2,), float(rank), dtype=torch.bfloat16))  # shm
    comm.all_reduce_coalesced([torch.ones(2), torch.ones(3)])  # one shm call on the flat buffer
    comm.broadcast(torch.ones(2))  # never the fast path
    strided = torch.arange(12.0).view(3, 4).t() * (rank + 1)  # non-contiguous: reduced through a copy
    comm.all_reduce(strided)
    assert torch.equal(strided, torch.arange(12.0).view(3, 4).t() * 3)
    paths = {
        "noncontiguous": comm.path_for("sum", torch.ones(3, 4).t()),
        "fp32 sum": comm.path_for("sum", torch.ones(3)),
        "min": comm.path_for("min", torch.ones(3)),
    }
    comm.close()
    return {
        "f32": f32.tolist(),
        "shard": shard.tolist(),
        "out": out.tolist(),
        "calls": [(n, o, str(d)) for n, o, d in fake.calls],
        "closed": fake.closed,
        "paths": paths,
        "logged": sorted((row.op, row.path, row.count) for row in logger.summary()),
    }


@pytest.mark.multiprocess
def test_routing_to_the_fast_path() -> None:
    res = run_distributed(_routing_body, world_size=2)[0]
    assert res["calls"] == [
        ("all_reduce", "sum", "torch.float32"),
        ("all_reduce", "avg", "torch.bfloat16"),
        ("all_reduce", "sum", "torch.float16"),
        ("reduce_scatter", "avg", "torch.float16"),
        ("all_gather", "-", "torch.bfloat16"),
        ("all_reduce", "sum", "torch.float32"),
        ("all_reduce", "sum", "torch.float32"),
    ]
    assert res["f32"] == [1.0] * 5 and res["shard"] == [1.0, 1.0] and res["out"] == [0.0, 0.0, 1.0, 1.0]
    assert res["closed"]
    assert res["paths"] == {"noncontiguous": "gloo", "fp32 sum": "shm", "min": "gloo"}
    assert res["logged"] == [
        ("all_gather", "shm", 1),
        ("all_reduce", "gloo", 3),
        ("all_reduce", "shm", 4),
        ("all_reduce_coalesced", "shm", 1),
        ("broadcast", "gloo", 1),
        ("reduce_scatter", "shm", 1),
    ]


@contextlib.contextmanager
def _shm_module(create: Any) -> Iterator[None]:
    module = types.ModuleType("ds_strategy.comm.shm")
    module.ShmCommunicator = types.SimpleNamespace(create=create)  # type: ignore[attr-defined]
    saved = sys.modules.get("ds_strategy.comm.shm")
    sys.modules["ds_strategy.comm.shm"] = module
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("ds_strategy.comm.shm", None)
        else:
            sys.modules["ds_strategy.comm.shm"] = saved


def _switch_body(rank: int, world: int) -> dict[str, Any]:
    created: list[Any] = []

    def create(group: Any = None, *, timeout: float | None = None) -> FakeShm:
        created.append(group)
        return FakeShm(group)

    res: dict[str, Any] = {}
    with _shm_module(create):
        res["auto"] = type(Communicator().fast_path).__name__
        res["off_by_arg"] = Communicator(fast_path=False).fast_path
        os.environ["DS_STRATEGY_SHM"] = "0"
        try:
            res["off_by_env"] = Communicator().fast_path
            res["forced_despite_env"] = type(Communicator(fast_path=True).fast_path).__name__
        finally:
            del os.environ["DS_STRATEGY_SHM"]
        res["created"] = len(created)
    with _shm_module(lambda group=None, timeout=None: None):
        res["unavailable"] = Communicator().fast_path
        with pytest.raises(RuntimeError, match="fast path is unavailable"):
            Communicator(fast_path=True)
    return res


@pytest.mark.multiprocess
def test_fast_path_switches() -> None:
    res = run_distributed(_switch_body, world_size=2)[0]
    assert res == {
        "auto": "FakeShm",
        "off_by_arg": None,
        "off_by_env": None,
        "forced_despite_env": "FakeShm",
        "created": 2,
        "unavailable": None,
    }


def test_missing_shm_module_means_no_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.comm import collectives

    # A build without ds_strategy.comm.shm: no fast path, quietly.
    monkeypatch.setitem(sys.modules, "ds_strategy.comm.shm", None)
    assert collectives._create_shm(None) is None
    monkeypatch.delitem(sys.modules, "ds_strategy.comm.shm")
    # The module exists but a dependency of it is missing: that is a broken install, not "no fast path".
    monkeypatch.setattr("builtins.__import__", _fail_for("ds_strategy.comm.shm", ModuleNotFoundError("x", name="dep")))
    with pytest.raises(ModuleNotFoundError):
        collectives._create_shm(None)
    # Any other import failure: one warning, torch.distributed only.
    monkeypatch.setattr("builtins.__import__", _fail_for("ds_strategy.comm.shm", ImportError("bad symbol")))
    with pytest.warns(UserWarning, match="shared-memory collectives unavailable"):
        assert collectives._create_shm(None) is None


def _fail_for(target: str, error: Exception) -> Any:
    real = __import__

    def importer(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if name == target:
            raise error
        return real(name, globals, locals, fromlist, level)

    return importer


def test_a_group_of_one_is_local(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_strategy.comm import init_distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_process_group wraps it (tests/leak_police.py)
    init_distributed()
    try:
        comm = Communicator()
        x = torch.arange(4.0)
        comm.all_reduce(x, "avg")
        out = torch.empty(4)
        comm.reduce_scatter_tensor(out, x)
        gathered = torch.empty(4)
        comm.all_gather_into_tensor(gathered, out)
        comm.broadcast(x)
        comm.barrier()
        assert torch.equal(gathered, torch.arange(4.0)) and comm.path_for("sum", x) == "local"
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_distributed"):
        Communicator()


def _auto_body(rank: int, world: int) -> tuple[str, str, str, list[float]]:
    comm = Communicator()
    x = torch.full((1001,), float(rank), dtype=torch.bfloat16)
    comm.all_reduce(x, "avg")
    paths = (type(comm.fast_path).__name__, comm.path_for("sum", x), comm.path_for("max", x))
    comm.close()
    return (*paths, x[:2].tolist())


@pytest.mark.multiprocess
@pytest.mark.kernels
def test_auto_routes_cpu_floats_to_shared_memory(request: pytest.FixtureRequest) -> None:
    import importlib.util

    if importlib.util.find_spec("ds_strategy.comm.shm") is None:
        pytest.skip("this build has no ds_strategy.comm.shm (the shared-memory backend)")
    request.getfixturevalue("cpu_kernels")  # build once here; the ranks then load from the warm cache
    for world in (2, 4):
        results = run_distributed(_auto_body, world_size=world)
        mean = sum(range(world)) / world
        assert results[0] == ("ShmCommunicator", "shm", "gloo", [mean, mean])


# -- asynchronous fast path (comm/worker.py) ---------------------------------------------------------------


def _background_body(rank: int, world: int, use_async: str) -> dict[str, Any]:
    os.environ["DS_STRATEGY_SHM_ASYNC"] = use_async
    comm = Communicator(fast_path=True)
    gen = torch.Generator().manual_seed(rank)
    shards = [torch.randn(1000 + 17 * i, generator=gen) for i in range(6)]
    outs = [torch.empty(world * s.numel()) for s in shards]
    handles = []
    for i, (out, shard) in enumerate(zip(outs, shards, strict=True)):
        handles.append(comm.all_gather_into_tensor(out, shard, async_op=True))
        if i == 2:  # a synchronous call between queued ones keeps its place in the order
            mid = torch.full((5,), float(rank + 1))
            comm.all_reduce(mid)
    grads = torch.randn(world * 64, generator=gen)
    mine = torch.empty(64)
    handles.append(comm.reduce_scatter_tensor(mine, grads.clone(), async_op=True))
    for h in handles:
        h.wait()
    # The references, through gloo.
    ref_outs = []
    for shard in shards:
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard)
        ref_outs.append(torch.cat(parts))
    ref_grads = grads.clone()
    dist.all_reduce(ref_grads)
    # A mismatch is raised on every rank: by wait() when found on the background thread, else by the call.
    try:
        comm.all_gather_into_tensor(torch.empty(world * (3 + rank)), torch.ones(3 + rank), async_op=True).wait()
        error = ""
    except RuntimeError as err:
        error = str(err)
    threaded = comm._worker is not None
    comm.close()
    return {
        "gathers_equal": all(torch.equal(o, r) for o, r in zip(outs, ref_outs, strict=True)),
        "mid": mid.tolist(),
        "reduced_equal": torch.allclose(mine, ref_grads.view(world, -1)[rank]),
        "error": error,
        "threaded": threaded,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("use_async", ["1", "0"])
def test_async_fast_path_keeps_order_and_reports_errors(use_async: str, cpu_kernels: bool) -> None:
    for res in run_distributed(_background_body, world_size=2, args=(use_async,)):
        assert res["threaded"] == (use_async == "1")
        assert res["gathers_equal"] and res["reduced_equal"], res
        assert res["mid"] == [3.0] * 5
        assert "the ranks called different collectives" in res["error"], res["error"]


def test_worker_starts_on_first_job_and_stops_cleanly() -> None:
    """The thread exists only once an asynchronous call came, runs jobs in order, re-raises their errors,
    and is gone after close (also registered at exit: no thread is left to interpreter finalisation)."""
    from ds_strategy.comm.worker import CollectiveWorker

    worker = CollectiveWorker()
    assert worker._thread is None and worker.idle()
    order: list[int] = []
    jobs = [worker.submit(lambda i=i: order.append(i)) for i in range(5)]
    thread = worker._thread
    assert thread is not None and thread.daemon
    failing = worker.submit(lambda: (_ for _ in ()).throw(RuntimeError("peer mismatch")))
    for job in jobs:
        job.wait()
    with pytest.raises(RuntimeError, match="peer mismatch"):
        failing.wait()
    worker.run(lambda: order.append(5))  # after the queue: inline once idle
    assert order == [0, 1, 2, 3, 4, 5] and worker.idle()
    worker.close()
    worker.close()  # idempotent
    assert not thread.is_alive() and worker._thread is None
