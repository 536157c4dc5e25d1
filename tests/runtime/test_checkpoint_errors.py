"""Bad input gives one clear error naming the file or key and what was expected, on every rank, and
leaves every engine exactly as it was (weights, masters, optimizer state, counters)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import run_distributed
from tests.runtime.common import batches, engine_run, full_masters
from tests.runtime.test_checkpoint import COMBOS, GAS, MICRO, make_engine, optimizer_state

pytestmark = pytest.mark.multiprocess


def _save(rank: int, world: int, root: str) -> None:
    engine = make_engine(COMBOS[2])
    engine_run(engine, batches(2, MICRO * GAS * world), micro=MICRO, gas=GAS)
    engine.save_checkpoint(root, tag="good")
    engine.destroy()


def _snapshot(engine: Any) -> tuple[Any, ...]:
    weights = {n: p.detach().clone() for n, p in engine.module.state_dict().items()}
    return weights, full_masters(engine), optimizer_state(engine), engine.global_steps, engine.micro_steps


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y, strict=True))
        return bool(x == y)

    return eq(a, b)


def _errors(rank: int, world: int, root: str, cases: list[tuple[str, str | None]]) -> dict[str, str]:
    from ds_strategy.runtime.checkpoint import CheckpointError

    engine = make_engine(COMBOS[2], seed=4)
    engine_run(engine, batches(1, MICRO * GAS * world, seed=9), micro=MICRO, gas=GAS)
    before = _snapshot(engine)
    messages = {}
    for directory, tag in cases:
        with pytest.raises(CheckpointError) as info:
            engine.load_checkpoint(directory, tag=tag)
        assert _same(before, _snapshot(engine)), f"{directory} {tag}: the engine changed"
        messages[f"{Path(directory).name}:{tag}"] = str(info.value)
    # another model: a wider hidden layer
    import ds_strategy.runtime as rt
    from tests.runtime.common import Net, config

    other = Net(d_hidden=24)
    wide, _, _, _ = rt.initialize(model=other, config=config(stage=1, micro=MICRO, gas=GAS))
    with pytest.raises(CheckpointError) as info:
        wide.load_checkpoint(root, tag="good")
    messages["other model"] = str(info.value)
    wide.destroy()
    # a client state that would need pickle: refused before anything is written
    with pytest.raises(CheckpointError) as info:
        engine.save_checkpoint(root, tag="unsafe", client_state={"ok": 1, "obj": object()})
    messages["unsafe client state"] = str(info.value)
    assert not (Path(root) / "unsafe").exists() and not (Path(root) / ".unsafe.partial").exists()
    # different tags per rank: one checkpoint under rank 0's tag (checkpoint.tag_validation "Warn", the
    # default; "Fail" raises: tests/runtime/test_config_effects.py)
    assert engine.save_checkpoint(root, tag=f"t{rank}", save_latest=False) == str(Path(root) / "t0")
    # after all that, the good checkpoint still loads
    engine.load_checkpoint(root)
    engine.destroy()
    return messages


def test_bad_input(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_distributed(_save, world_size=2, args=(str(root),))
    good = root / "good"
    for name in ("truncated", "missing", "corrupt", "nometa"):
        shutil.copytree(good, root / name)
    rank1 = "zero_rank_00001_optim_states.pt"
    data = (root / "truncated" / rank1).read_bytes()
    (root / "truncated" / rank1).write_bytes(data[: len(data) // 2])
    (root / "missing" / rank1).unlink()
    (root / "corrupt" / rank1).write_bytes(b"\0" * len(data))  # right size, unreadable: only rank 1 reads it
    (root / "nometa" / "meta.pt").unlink()
    cases = [
        (str(root), "truncated"),
        (str(root), "missing"),
        (str(root), "corrupt"),
        (str(root), "nometa"),
        (str(root), "nope"),
        (str(good), None),
        (str(tmp_path), None),
        (str(tmp_path / "absent"), None),
    ]
    results = run_distributed(_errors, world_size=2, args=(str(root), cases))
    msgs = results[0]
    assert f"{rank1} has {len(data) // 2} bytes" in msgs["ckpt:truncated"] and "truncated" in msgs["ckpt:truncated"]
    assert f"{rank1} is missing" in msgs["ckpt:missing"]
    assert "is damaged" in msgs["ckpt:corrupt"] and rank1 in msgs["ckpt:corrupt"]
    assert "failed on rank 1" in results[0]["ckpt:corrupt"]  # rank 0's own file was fine: it names rank 1
    assert "holds no meta.pt" in msgs["ckpt:nometa"]
    assert "'nope' not found" in msgs["ckpt:nope"] and "'good'" in msgs["ckpt:nope"]
    assert "one level too deep" in msgs["good:None"] and "tag='good'" in msgs["good:None"]
    assert "one level deeper" in msgs[f"{tmp_path.name}:None"]
    assert "does not exist" in msgs["absent:None"]
    assert "saved from another model" in msgs["other model"] and "'fc1.weight'" in msgs["other model"]
    assert "[24, 16]" in msgs["other model"] and "[32, 16]" in msgs["other model"]
    assert "client_state['obj']" in msgs["unsafe client state"] and "weights_only" in msgs["unsafe client state"]
