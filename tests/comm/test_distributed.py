"""init_distributed: every step of its order (existing group, init_method, env, MPI discovery with a mocked
mpi4py and with launcher variables only, single process), its errors, and the timeout sources."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import shutil
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from benchmarks.common import environment as shared_environment

from ds_strategy import comm as ds_comm
from ds_strategy.comm import TIMEOUT_ENV, init_distributed, resolve_timeout
from ds_strategy.comm.distributed import ENV_VARS, discover_mpi
from ds_strategy.scheduler_env import first_host
from tests.harness import held_port, run_distributed

LAUNCHER_VARS = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_NODELIST",
    "AZ_BATCH_MASTER_NODE",
    "AZ_BATCHAI_MPI_MASTER_NODE",
)


def environment(set_: dict[str, str], unset: tuple[str, ...] = ()) -> contextlib.AbstractContextManager[None]:
    """Set and unset variables for the block, restoring everything afterwards, the rendezvous variables
    init_distributed may set included (workers are reused)."""
    return shared_environment({**dict.fromkeys(unset), **set_}, restore=(*ENV_VARS, TIMEOUT_ENV))


@contextlib.contextmanager
def module_stub(name: str, module: Any) -> Iterator[None]:
    """Put ``module`` (None blocks the import) in sys.modules for the block."""
    missing = object()
    saved = sys.modules.get(name, missing)
    sys.modules[name] = module
    try:
        yield
    finally:
        if saved is missing:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved  # type: ignore[assignment]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*ENV_VARS, *LAUNCHER_VARS, TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- a fake mpi4py ----------------------------------------------------------------------------------


class FileComm:
    """COMM_WORLD for ranks of the harness: bcast/allgather exchanged through files in a shared folder."""

    def __init__(self, rank: int, size: int, folder: str) -> None:
        self.rank, self.size, self.folder = rank, size, Path(folder)
        self.calls: list[str] = []
        self._n = 0

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def _put(self, name: str, value: Any) -> None:
        tmp = self.folder / f"{name}.tmp{self.rank}"
        tmp.write_bytes(pickle.dumps(value))
        tmp.rename(self.folder / name)

    def _get(self, name: str) -> Any:
        path = self.folder / name
        deadline = time.monotonic() + 30
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake MPI: rank {self.rank} waited 30 s for {name}")
            time.sleep(0.01)
        return pickle.loads(path.read_bytes())

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.calls.append("bcast")
        self._n += 1
        if self.rank == root:
            self._put(f"bcast{self._n}", obj)
            return obj
        return self._get(f"bcast{self._n}")

    def allgather(self, obj: Any) -> list[Any]:
        self.calls.append("allgather")
        self._n += 1
        self._put(f"ag{self._n}.{self.rank}", obj)
        return [self._get(f"ag{self._n}.{r}") for r in range(self.size)]


class ScriptedComm:
    """COMM_WORLD for one process playing one rank: scripted allgather / bcast answers."""

    def __init__(self, rank: int, size: int, hosts: list[str], bcast_answer: Any = None) -> None:
        self.rank, self.size, self.hosts, self.bcast_answer = rank, size, hosts, bcast_answer
        self.bcast_proposals: list[Any] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def allgather(self, obj: Any) -> list[Any]:
        return list(self.hosts)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.bcast_proposals.append(obj)
        return obj if self.rank == root else self.bcast_answer


def fake_mpi4py(comm: Any) -> types.ModuleType:
    module = types.ModuleType("mpi4py")
    module.MPI = types.SimpleNamespace(COMM_WORLD=comm)  # type: ignore[attr-defined]
    return module


# ---- step 1: reuse ----------------------------------------------------------------------------------


def _reuse_body(rank: int, world_size: int) -> tuple[str, int, int, bool, list[str]]:
    world = dist.group.WORLD
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = init_distributed(timeout=5)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=info.group)
    queries = (ds_comm.get_rank(), ds_comm.get_world_size(info.group), ds_comm.get_local_rank())
    ds_comm.barrier()
    return info.source, info.rank, info.world_size, info.group is world, [str(w.message) for w in caught], queries


def test_reuses_an_initialised_default_group() -> None:
    results = run_distributed(_reuse_body, world_size=2)
    for rank, (source, r, w, same, caught, queries) in enumerate(results):
        assert (source, r, w, same) == ("existing", rank, 2, True)
        assert any("timeout ignored" in m for m in caught), caught
        assert queries == (rank, 2, rank)  # deepspeed.comm's queries; the harness sets LOCAL_RANK


def test_queries_before_any_group_name_the_call_to_make(clean_env: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized() and not ds_comm.is_initialized()
    for query in (ds_comm.get_rank, ds_comm.get_world_size, ds_comm.barrier):
        with pytest.raises(RuntimeError, match=r"not initialised; call ds_strategy.init_distributed\(\)"):
            query()
    assert ds_comm.get_local_rank() == 0  # no launcher variable names one
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert ds_comm.get_local_rank() == 3


# ---- step 2: explicit init_method ---------------------------------------------------------------------


def _init_method_body(rank: int, world_size: int, port: int) -> tuple[str, int, float]:
    info = init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return info.source, info.rank, t.item()


def test_explicit_init_method() -> None:
    with held_port() as port:
        results = run_distributed(_init_method_body, world_size=2, args=(port,), init_process_group=False)
    assert results == [("init_method", 0, 3.0), ("init_method", 1, 3.0)]


# ---- step 3: environment variables --------------------------------------------------------------------


def _env_body(rank: int, world_size: int, drop_local_rank: bool) -> dict[str, Any]:
    unset = ("LOCAL_RANK",) if drop_local_rank else ()
    with environment({}, unset=unset):
        assert not dist.is_initialized()
        info = init_distributed()
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return {
            "info": (info.source, info.rank, info.world_size, info.local_rank, info.backend),
            "sum": t.item(),
            "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
            "is_default": info.group is dist.group.WORLD,
        }


@pytest.mark.parametrize("world_size", [2, 4])
def test_env_variables(world_size: int) -> None:
    results = run_distributed(_env_body, world_size=world_size, args=(False,), init_process_group=False)
    total = float(sum(range(world_size)))
    for rank, res in enumerate(results):
        assert res["info"] == ("env", rank, world_size, rank, "gloo")
        assert res["sum"] == total and res["is_default"]


def test_env_without_local_rank_derives_it_from_host_names() -> None:
    results = run_distributed(_env_body, world_size=2, args=(True,), init_process_group=False)
    for rank, res in enumerate(results):
        assert res["info"][3] == rank  # every rank on this host: local rank == rank
        assert res["LOCAL_RANK"] == str(rank)  # and exported for the libraries that read it


def _env_port_default_body(rank: int, world_size: int) -> tuple[str, str | None]:
    port = os.environ["MASTER_PORT"]
    with environment({}, unset=("MASTER_PORT",)):
        info = init_distributed(distributed_port=int(port))
        return str(info.master_port), os.environ.get("MASTER_PORT")


def test_env_master_port_defaults_to_distributed_port() -> None:
    results = run_distributed(_env_port_default_body, world_size=2, init_process_group=False)
    assert results[0][0] == results[1][0] == results[0][1]


@pytest.mark.parametrize(
    ("present", "missing"),
    [
        ({"RANK": "0"}, ["WORLD_SIZE", "MASTER_ADDR"]),
        ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR"]),
        ({"LOCAL_RANK": "0"}, ["RANK", "WORLD_SIZE", "MASTER_ADDR"]),
        ({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "4"}, ["RANK"]),
    ],
)
@pytest.mark.parametrize("auto_mpi_discovery", [True, False])
def test_partial_environment_names_the_missing_variables(
    clean_env: pytest.MonkeyPatch, present: dict[str, str], missing: list[str], auto_mpi_discovery: bool
) -> None:
    for k, v in present.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError) as err:
        init_distributed(auto_mpi_discovery=auto_mpi_discovery)
    message = str(err.value)
    head = message.split(" missing")[0]
    for name in missing:
        assert name in head, message
    assert "torchrun" in message
    assert not dist.is_initialized()


def test_rank_outside_world_is_an_error(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"RANK=3 is outside \[0, WORLD_SIZE=2\)"):
        init_distributed(rank=3, world_size=2)


def test_garbage_in_a_variable_is_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero' is not an integer"):
        init_distributed()


# ---- step 4: MPI discovery ---------------------------------------------------------------------------


def _mpi_body(rank: int, world_size: int, folder: str, hosts: list[str] | None) -> dict[str, Any]:
    import socket

    port = int(os.environ["MASTER_PORT"])
    launcher = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world_size),
        "OMPI_COMM_WORLD_LOCAL_RANK": "99",  # mpi4py's answers must win over these
    }
    if hosts is not None and rank == 0:
        launcher["MASTER_ADDR"] = "127.0.0.1"  # only rank 0 knows: the others learn it by broadcast
    comm = FileComm(rank, world_size, folder)
    real_gethostname = socket.gethostname
    if hosts is not None:
        socket.gethostname = lambda: hosts[rank]  # type: ignore[assignment]
    try:
        with environment(launcher, unset=ENV_VARS), module_stub("mpi4py", fake_mpi4py(comm)):
            info = init_distributed(distributed_port=port)
            t = torch.tensor([1.0])
            dist.all_reduce(t)
            exported = {k: os.environ.get(k) for k in ENV_VARS}
    finally:
        socket.gethostname = real_gethostname  # type: ignore[assignment]
    return {
        "info": (info.source, info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port),
        "sum": t.item(),
        "calls": comm.calls,
        "env": exported,
    }


def test_mpi_discovery_with_mocked_mpi4py(tmp_path: Path) -> None:
    with held_port() as port:
        results = run_distributed(
            _mpi_body,
            world_size=2,
            args=(str(tmp_path), None),
            init_process_group=False,
            env={"MASTER_PORT": str(port)},
        )
    for rank, res in enumerate(results):
        assert res["info"] == ("mpi", rank, 2, rank, "127.0.0.1", port)
        assert res["sum"] == 2.0
        assert res["calls"] == ["allgather", "bcast"]
        assert res["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }


def test_mpi_discovery_derives_local_rank_from_host_names(tmp_path: Path) -> None:
    hosts = ["node-a", "node-b", "node-a", "node-b"]
    with held_port() as port:
        results = run_distributed(
            _mpi_body,
            world_size=4,
            args=(str(tmp_path), hosts),
            init_process_group=False,
            env={"MASTER_PORT": str(port)},
        )
    assert [res["info"][3] for res in results] == [0, 0, 1, 1]
    assert all(res["info"][4] == "127.0.0.1" for res in results)  # rank 0's address, broadcast
    assert all(res["sum"] == 4.0 for res in results)


def test_mpi4py_scripted_rank_zero_proposes_loopback_on_one_host(clean_env: pytest.MonkeyPatch) -> None:
    comm = ScriptedComm(0, 2, ["h", "h"])
    with module_stub("mpi4py", fake_mpi4py(comm)):
        found = discover_mpi({"PMI_SIZE": "2", "PMI_RANK": "0"}, port=1234)
    assert found is not None
    assert (found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == (
        0,
        2,
        0,
        "127.0.0.1",
        1234,
    )
    assert comm.bcast_proposals == [("127.0.0.1", 1234)]


def test_mpi4py_scripted_other_rank_takes_the_broadcast(clean_env: pytest.MonkeyPatch) -> None:
    comm = ScriptedComm(3, 4, ["a", "a", "b", "b"], bcast_answer=("10.1.2.3", 6000))
    with module_stub("mpi4py", fake_mpi4py(comm)):
        found = discover_mpi({"OMPI_COMM_WORLD_SIZE": "4", "MASTER_PORT": "7"}, port=1234)
    assert found is not None
    assert (found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port) == (
        3,
        4,
        1,
        "10.1.2.3",
        6000,
    )
    assert comm.bcast_proposals == [None]


def test_mpi4py_is_not_imported_without_an_mpi_launcher(clean_env: pytest.MonkeyPatch) -> None:
    # Importing mpi4py initialises MPI: only do it when an MPI launcher started us.
    comm = ScriptedComm(0, 8, ["h"] * 8)
    with module_stub("mpi4py", fake_mpi4py(comm)):
        assert discover_mpi({}, port=1) is None
    assert comm.bcast_proposals == []


def _launcher_body(rank: int, world_size: int, kind: str) -> tuple[str, int, int, int | None, str | None, int | None]:
    port = os.environ["MASTER_PORT"]
    variables = {
        "openmpi": {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(world_size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(world_size),
            "MASTER_PORT": port,
        },
        "azureml": {  # multi-node style: the master comes from AZ_BATCH_MASTER_NODE, port included
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(world_size),
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
            "AZ_BATCH_MASTER_NODE": f"127.0.0.1:{port}",
        },
        "pmi": {
            "PMI_RANK": str(rank),
            "PMI_SIZE": str(world_size),
            "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": str(world_size),
            "MASTER_PORT": port,
        },
        "slurm": {
            "SLURM_PROCID": str(rank),
            "SLURM_STEP_NUM_TASKS": str(world_size),
            "SLURM_LOCALID": str(rank),
            "SLURM_STEP_NODELIST": "localhost,other[01-04]",
            "MASTER_PORT": port,
        },
    }[kind]
    # Block a real mpi4py, if one is installed, so that only the launcher's variables are read.
    with environment(variables, unset=ENV_VARS), module_stub("mpi4py", None):
        info = init_distributed()
        return info.source, info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port


@pytest.mark.parametrize("kind", ["openmpi", "azureml", "pmi", "slurm"])
def test_launcher_variables_without_mpi4py(kind: str) -> None:
    with held_port() as port:
        results = run_distributed(
            _launcher_body, world_size=2, args=(kind,), init_process_group=False, env={"MASTER_PORT": str(port)}
        )
    addr = "localhost" if kind == "slurm" else "127.0.0.1"
    local = [0, 0] if kind == "azureml" else [0, 1]
    assert results == [("launcher", r, 2, local[r], addr, port) for r in range(2)]


def test_launcher_without_master_address_says_how_to_fix(clean_env: pytest.MonkeyPatch) -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with module_stub("mpi4py", None), pytest.raises(ValueError, match=r"MASTER_ADDR.*mpi4py"):
        discover_mpi(env)


def test_slurm_batch_step_without_srun_is_not_a_launch(clean_env: pytest.MonkeyPatch) -> None:
    # sbatch sets SLURM_PROCID / SLURM_NTASKS for the batch script itself; only srun sets STEP_NUM_TASKS.
    assert discover_mpi({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}) is None


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu07", "gpu07"),
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("a1,b[1-2]", "a1"),
        ("rack[2-3]-ib", "rack2-ib"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on this machine (the mocked tests cover MPI)")
def test_real_mpirun(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch, torch.distributed as dist, ds_strategy\n"
        "info = ds_strategy.init_distributed()\n"
        "t = torch.ones(1); dist.all_reduce(t)\n"
        "print(info.source, info.rank, info.world_size, info.local_rank, int(t.item()), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    flags = ["--oversubscribe", "--allow-run-as-root"] if "Open MPI" in version or "OpenRTE" in version else []
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"), env.get("PYTHONPATH", "")])
    with held_port() as port:
        env["MASTER_PORT"] = str(port)
        proc = subprocess.run(
            ["mpirun", *flags, "-np", "2", sys.executable, str(script)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line.split() for line in proc.stdout.splitlines() if line.strip())
    assert [line[1:] for line in lines] == [["0", "2", "0", "2"], ["1", "2", "1", "2"]]
    assert {line[0] for line in lines} <= {"mpi", "launcher"}


# ---- step 5: single process, and timeouts -------------------------------------------------------------


@contextlib.contextmanager
def destroyed_afterwards() -> Iterator[None]:
    hook = sys.excepthook  # init_process_group wraps it and destroy does not unwrap (tests/leak_police.py)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = hook


def test_single_process_fallback(clean_env: pytest.MonkeyPatch) -> None:
    before = dict(os.environ)
    with destroyed_afterwards():
        info = init_distributed()
        assert (info.source, info.rank, info.world_size, info.local_rank, info.backend) == ("single", 0, 1, 0, "gloo")
        assert info.master_addr == "127.0.0.1" and info.master_port and info.master_port > 0
        assert not info.is_distributed
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        # A later Lightning Trainer must not think the process was started by a launcher.
        assert dict(os.environ) == before
        assert init_distributed().source == "existing"


def test_single_process_without_discovery(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")  # ignored when discovery is off
    with destroyed_afterwards():
        assert init_distributed(auto_mpi_discovery=False).source == "single"


def _pg_timeout() -> datetime.timedelta:
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return backend.options._timeout  # type: ignore[no-any-return]


def test_timeout_from_environment(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(TIMEOUT_ENV, "7.5")
    with destroyed_afterwards():
        info = init_distributed()
        assert info.timeout == datetime.timedelta(seconds=7.5)
        assert _pg_timeout() == datetime.timedelta(seconds=7.5)


def test_timeout_argument_wins(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(TIMEOUT_ENV, "7")
    with destroyed_afterwards():
        info = init_distributed(timeout=datetime.timedelta(seconds=42))
        assert info.timeout == datetime.timedelta(seconds=42) == _pg_timeout()


def test_resolve_timeout(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_timeout(None) is None
    assert resolve_timeout(3) == datetime.timedelta(seconds=3)
    assert resolve_timeout(0.5) == datetime.timedelta(milliseconds=500)
    for bad in (0, -1, True, "10", datetime.timedelta(0)):
        with pytest.raises(ValueError, match="timeout"):
            resolve_timeout(bad)  # type: ignore[arg-type]
    for raw in ("soon", "-3", "0"):
        clean_env.setenv(TIMEOUT_ENV, raw)
        with pytest.raises(ValueError, match=TIMEOUT_ENV):
            resolve_timeout(None)


_EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("initialised at exit:", dist.is_initialized(), flush=True))  # runs after ours
import ds_strategy
ds_strategy.init_distributed()
if sys.argv[1] == "raise":
    raise SystemError("boom")
"""


@pytest.mark.parametrize(("how", "still_initialised"), [("clean", False), ("raise", True)])
def test_the_group_is_destroyed_at_a_normal_exit_only(tmp_path: Path, how: str, still_initialised: bool) -> None:
    """[Note: clean exits by ownership]: left to finalisation gloo can abort a successful rank, so the group
    init_distributed created is destroyed at a normal exit; after an uncaught exception it is left alone (a
    peer may still be inside a collective)."""
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=env, timeout=120)
    assert f"initialised at exit: {still_initialised}" in proc.stdout, proc.stdout + proc.stderr
    assert (proc.returncode == 0) == (how == "clean"), proc.stderr
