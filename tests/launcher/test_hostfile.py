"""Hostfiles, --include / --exclude filters and their resolution into a WorldPlan; every error names its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_strategy.launcher.hostfile import (
    HostfileError,
    Node,
    WorldPlan,
    parse_filter,
    parse_hostfile,
    parse_hostfile_text,
    resolve_plan,
)

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


def test_hostfile_lines_comments_and_blanks(tmp_path: Path) -> None:
    path = tmp_path / "hostfile"
    path.write_text("# the cluster\n\nworker-1 slots=4   # first\n  worker-2 slots=2\n\n10.0.0.7 slots=8\n")
    assert parse_hostfile(path) == {"worker-1": 4, "worker-2": 2, "10.0.0.7": 8}
    assert list(parse_hostfile(path)) == ["worker-1", "worker-2", "10.0.0.7"]  # file order = node order


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("worker-1 slots=4\nworker-2\n", 2, "expected 'HOST slots=N'"),
        ("worker-1 slots=four\n", 1, "positive integer"),
        ("worker-1 slots=0\n", 1, "positive integer"),
        ("worker-1 slots=2\n# x\nworker-1 slots=2\n", 3, "listed twice"),
        ("worker-1 slots=2 extra\n", 1, "expected 'HOST slots=N'"),
        ("worker-1 slot=2\n", 1, "expected 'HOST slots=N'"),
        ("work!er slots=2\n", 1, "not a host name"),
    ],
)
def test_hostfile_errors_name_file_and_line(text: str, line: int, words: str) -> None:
    with pytest.raises(HostfileError, match=rf"^hosts\.txt:{line}: .*{words}"):
        parse_hostfile_text(text, source="hosts.txt")


def test_hostfile_empty_or_missing(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match=r"hosts\.txt: no hosts listed"):
        parse_hostfile_text("# nothing\n\n", source="hosts.txt")
    with pytest.raises(HostfileError, match=r"cannot read hostfile .*nope"):
        parse_hostfile(tmp_path / "nope")


def test_filter_syntax() -> None:
    assert parse_filter("worker-0:0,1@worker-1") == {"worker-0": [0, 1], "worker-1": None}
    assert parse_filter("worker-0:3,1@worker-0:1") == {"worker-0": [1, 3]}
    assert parse_filter("worker-0@worker-0:1") == {"worker-0": None}  # all slots stays all


@pytest.mark.parametrize(
    ("spec", "token"),
    [
        ("worker-0@@worker-1", "empty entry"),
        ("worker-0:0,x", "'x' is not a slot index"),
        (":0", "':0'"),
        ("worker-0:", "'' is not a slot index"),
        ("worker-0:1,-2", "'-2' is not a slot index"),
    ],
)
def test_filter_errors_name_the_token(spec: str, token: str) -> None:
    with pytest.raises(HostfileError, match=rf"--exclude '{spec}'.*{token}"):
        parse_filter(spec, flag="--exclude")


def test_resolve_whole_pool_and_limits() -> None:
    plan = resolve_plan(POOL)
    assert plan.nodes == (Node("worker-0", (0, 1, 2, 3)), Node("worker-1", (0, 1, 2, 3)), Node("worker-2", (0, 1)))
    assert (plan.world_size, plan.num_nodes, plan.uniform_procs()) == (10, 3, None)
    plan = resolve_plan(POOL, num_nodes=2, num_procs=2)
    assert plan.nodes == (Node("worker-0", (0, 1)), Node("worker-1", (0, 1)))
    assert plan.uniform_procs() == 2


def test_include_keeps_named_slots_in_hostfile_order() -> None:
    plan = resolve_plan(POOL, include="worker-2@worker-0:1,3")
    assert plan.nodes == (Node("worker-0", (1, 3)), Node("worker-2", (0, 1)))
    assert not plan.nodes[0].is_contiguous and plan.nodes[1].is_contiguous


def test_exclude_drops_slots_and_whole_hosts() -> None:
    plan = resolve_plan(POOL, exclude="worker-1@worker-0:0")
    assert plan.nodes == (Node("worker-0", (1, 2, 3)), Node("worker-2", (0, 1)))
    # Excluding every slot of a host drops the host.
    assert resolve_plan(POOL, exclude="worker-2:0,1").hosts == ["worker-0", "worker-1"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "worker-9"}, r"--include: host 'worker-9' is not in the resource pool \(known: worker-0, "),
        ({"exclude": "worker-2:2"}, r"--exclude: slot 2 of host 'worker-2' does not exist \(it has 2 slots: 0\.\.1\)"),
        ({"include": "worker-0", "exclude": "worker-1"}, "cannot be used together"),
        ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no hosts"),
        ({"num_nodes": 4}, r"--num_nodes 4 asks for more hosts than available \(3"),
        ({"num_procs": 3}, r"--num_procs 3 asks for more slots than host 'worker-2' has available \(2\)"),
    ],
)
def test_resolution_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        resolve_plan(POOL, **kwargs)  # type: ignore[arg-type]


def test_plan_round_trips_through_world_info() -> None:
    plan = resolve_plan(POOL, include="worker-0:1,3@worker-2")
    text = plan.encode()
    assert text.replace("=", "").replace("-", "").replace("_", "").isalnum()  # shell-safe
    assert WorldPlan.decode(text) == plan
    with pytest.raises(HostfileError, match="--world_info is not a plan"):
        WorldPlan.decode("bm90IGpzb24=")


def test_is_local() -> None:
    assert WorldPlan((Node("localhost", (0, 1)),)).is_local()
    assert not WorldPlan((Node("worker-0", (0,)),)).is_local()
    assert not WorldPlan((Node("localhost", (0,)), Node("127.0.0.1", (0,)))).is_local()
