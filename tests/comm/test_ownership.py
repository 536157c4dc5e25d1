"""Clean exits by ownership (issue 43, criterion 3; [Note: clean exits by ownership] in comm/ownership.py).

The package destroys the process groups it created (init_distributed's default group, the subgroups a
``GroupSet`` records) and releases its own communicators; it never touches a group, or an object holding
one, that it did not create; its exit handler does not walk the heap, so it takes the same few
milliseconds whatever the heap size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_strategy.comm import Communicator, GroupSet, init_distributed, ownership
from ds_strategy.comm.distributed import ENV_VARS

# Registered before anything else, so that it runs last, after ds_strategy's handler: it reports what the
# script's objects hold by then, whether the groups are still registered, and the gloo threads left.
_PRELUDE = """
import atexit, gc, json, os, sys, time
marks = {}
def _report():
    marks["last"] = time.perf_counter()
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
    names = []
    for t in tasks:
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    out = {k: v() for k, v in CHECKS.items()}
    out["gloo_threads"] = sorted(n for n in names if "gloo" in n)
    out["handlers_seconds"] = marks["last"] - marks.get("first", marks["last"])
    print("REPORT " + json.dumps(out), flush=True)
CHECKS = {}
atexit.register(_report)
import torch
import torch.distributed as dist
import ds_strategy

def _engine():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1}}
    engine, *_ = ds_strategy.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    loss = engine(torch.randn(2, 8)).square().mean()
    engine.backward(loss)
    engine.step()
    return engine
"""

_USER_OBJECTS = (
    _PRELUDE
    + """
if sys.argv[1] == "theirs":  # the script makes the default group itself
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
else:  # ds_strategy makes it; the script makes a subgroup of its own
    ds_strategy.init_distributed()
user_group = dist.new_group([0]) if sys.argv[1] == "ours" else dist.group.WORLD
engine = _engine()

class Holder:
    pass

holder = Holder()
holder.pg = user_group
groups = {"0": user_group, "world": dist.group.WORLD}
module = torch.nn.Linear(2, 2)
module.pg = user_group
expected = {"holder": id(user_group), "dict": [id(user_group), id(dist.group.WORLD)], "module": id(user_group)}
CHECKS["same_objects"] = lambda: {
    "holder": id(holder.pg), "dict": [id(groups["0"]), id(groups["world"])], "module": id(module.pg)
} == expected
CHECKS["user_group_registered"] = lambda: user_group in dist.distributed_c10d._world.pg_map
CHECKS["initialized"] = lambda: dist.is_initialized()
atexit.register(lambda: marks.setdefault("first", time.perf_counter()))  # runs first
"""
)


def _run(tmp_path: Path, source: str, *args: str) -> tuple[dict[str, object], subprocess.CompletedProcess[str]]:
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in (*ENV_VARS, "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("REPORT ") :]), proc


@pytest.mark.parametrize("who", ["theirs", "ours"])
def test_the_scripts_groups_and_their_holders_are_left_alone_at_exit(tmp_path: Path, who: str) -> None:
    """A user object's attribute, a dict of groups and an nn.Module attribute hold the same groups after
    ds_strategy's exit handler as before; a group the script made is still registered. 'theirs': the script
    made the default group (ds_strategy ran an engine on it); 'ours': init_distributed made it and the script
    made a subgroup, which it did not destroy: the package then leaves its default group too, and says so."""
    report, proc = _run(tmp_path, _USER_OBJECTS, who)
    assert report["same_objects"] is True, report
    assert report["user_group_registered"] is True, report
    assert report["initialized"] is True, report
    if who == "ours":
        assert "that ds_strategy did not create are still registered" in proc.stderr, proc.stderr


_HEAP = (
    _PRELUDE
    + """
import weakref
from ds_strategy.comm import Communicator, GroupSet

ds_strategy.init_distributed()
engine = _engine()

class Owner:  # a package-style owner: a subgroup in a GroupSet, a communicator on it
    def __init__(self):
        self.owned = GroupSet(self, attributes=("group",))
        self.group = self.owned.new_group([0])
        self.comm = Communicator(self.group)

owner = Owner()
world = weakref.ref(dist.group.WORLD)
sub = weakref.ref(owner.group)
heap = [[] for _ in range(int(sys.argv[1]))]  # tracked objects: a heap walk would visit each
CHECKS["objects"] = lambda: len(gc.get_objects())
CHECKS["world_alive"] = lambda: world() is not None
CHECKS["subgroup_alive"] = lambda: sub() is not None
CHECKS["owner_group"] = lambda: owner.group
atexit.register(lambda: marks.setdefault("first", time.perf_counter()))  # runs first
"""
)


def test_the_exit_handler_releases_what_the_package_created_fast_whatever_the_heap(tmp_path: Path) -> None:
    """With 2M live objects the handlers between the script's first and last atexit handler (ds_strategy's)
    take < 100 ms; the default group and a GroupSet's subgroup are destroyed and dead (their last reference
    died inside the handler: weak references report it), no gloo thread is left for finalisation."""
    report, _ = _run(tmp_path, _HEAP, "2000000")
    assert int(report["objects"]) >= 2_000_000  # type: ignore[call-overload]
    assert report["world_alive"] is False and report["subgroup_alive"] is False, report
    assert report["owner_group"] is None, report  # the owner's declared attribute
    assert report["gloo_threads"] == [], report
    assert float(report["handlers_seconds"]) < 0.1, report  # type: ignore[arg-type]


@pytest.fixture
def single_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (*ENV_VARS, "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    hook = sys.excepthook  # init_process_group wraps it and destroy does not unwrap (tests/leak_police.py)
    init_distributed()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.excepthook = hook


class _Owner:
    def __init__(self) -> None:
        self.owned = GroupSet(self, attributes=("group", "by_key"))
        self.group = self.owned.new_group([0])
        self.by_key = {"a": {"group": self.group, "ranks": [0]}}
        self.comm = Communicator(self.group)


def test_group_set_destroy_releases_exactly_its_groups(single_group: None) -> None:
    owner = _Owner()
    other = dist.new_group([0])  # not the owner's: left alone
    other_comm = Communicator(other)
    dead = weakref.ref(owner.group)
    assert owner.group in owner.owned and len(owner.owned) == 1
    owner.owned.destroy()
    assert owner.group is None and owner.by_key == {"a": {"group": None, "ranks": [0]}}
    assert dead() is None  # the last reference died in destroy(): gloo joined its threads there
    with pytest.raises(RuntimeError, match="this communicator was released"):
        owner.comm.all_reduce(torch.ones(1))
    assert other in dist.distributed_c10d._world.pg_map and other_comm.group is other
    other_comm.all_reduce(torch.ones(1))  # still usable
    owner.owned.destroy()  # idempotent
    dist.destroy_process_group(other)


def test_torch_defaults_are_none_when_the_package_creates_the_group(single_group: None) -> None:
    """init_distributed imports torch.distributed.nn.functional before creating the group, so torch's
    ``group=group.WORLD`` default values are None, not the group: torch holds nothing."""
    import torch.distributed.nn.functional as fn

    if any(isinstance(v, dist.ProcessGroup) for v in fn.all_reduce.__defaults__ or ()):
        pytest.skip("torch.distributed.nn.functional was imported while an earlier group existed")
    assert dist.group.WORLD not in (fn.all_reduce.__defaults__ or ())


def test_release_torch_defaults_touches_only_destroyed_groups(single_group: None) -> None:
    import torch.distributed.nn.functional as fn

    live = dist.new_group([0])
    gone = dist.new_group([0])
    saved = fn.broadcast.__defaults__, fn.gather.__defaults__
    try:
        fn.broadcast.__defaults__ = (live,)  # as if imported while ``live`` was the default group
        fn.gather.__defaults__ = (0, gone)
        dist.destroy_process_group(gone)
        assert ownership.release_torch_defaults() == 1
        assert fn.broadcast.__defaults__ == (live,) and fn.gather.__defaults__ == (0, None)
    finally:
        fn.broadcast.__defaults__, fn.gather.__defaults__ = saved
        dist.destroy_process_group(live)


_FAILING_RANK = """
import os, sys, time
import ds_strategy
ds_strategy.init_distributed()
if os.environ["RANK"] == "1":
    print("raising at", time.time(), flush=True)
    raise RuntimeError("rank 1 fails")
time.sleep(float(sys.argv[1]))  # rank 0 works on; it reaches exit long after rank 1 is gone
"""


def test_a_rank_that_failed_does_not_wait_for_its_peers(tmp_path: Path) -> None:
    """Rank 1 raises while rank 0 works on for 20 s: rank 1 is gone within seconds (its handler neither
    waits in the exit meeting nor tears down), whatever DS_STRATEGY_EXIT_WAIT allows."""
    import time

    from tests.launcher.common import free_port

    script = tmp_path / "fail.py"
    script.write_text(_FAILING_RANK)
    base = {k: v for k, v in os.environ.items() if k not in (*ENV_VARS, "LOCAL_RANK")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    base["DS_STRATEGY_EXIT_WAIT"] = "300"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "20"],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out, err = procs[1].communicate(timeout=120)
        ended = time.time()
        raised = float(next(line.split()[-1] for line in out.splitlines() if line.startswith("raising at")))
        assert procs[1].returncode == 1 and "rank 1 fails" in err, err
        assert ended - raised < 10, (ended - raised, err)  # 300 s if it waited for rank 0
        assert procs[0].poll() is None  # rank 0 is still working: nobody met rank 1 at exit
    finally:
        for p in procs:
            p.kill()
            p.communicate()
