"""A pipeline run saves, is SIGKILLed in the middle of its next save, and resumes bit-exactly.

Two processes (2 stages) train with dropout (so the resumed run must also restore each rank's RNG state) in
subprocesses that save tag ``A`` after the first step, train a second step and save again with the
test-only hook ``DS_STRATEGY_CKPT_TEST_PAUSE`` (checkpoint/format.py: every file is announced on stderr,
then written after a pause); the test kills both processes at one of three moments, one run each, as
tests/runtime/test_checkpoint_kill.py does for the main format:

- ``shard``: while rank 0 writes its shard (``pipe_rank_00000_states.pt``) of tag ``B``;
- ``latest``: after ``B`` was published, before ``latest`` was rewritten;
- ``swap``: while a re-save of tag ``A`` is between its two renames (the old copy set aside).

Each time ``latest`` still names ``A``, the consolidated weights are those saved at step 1 (bit for bit),
and fresh processes that load the directory and train steps 2-3 get exactly the losses of an
uninterrupted run (``==``, not a tolerance: same grid, same reduction order, RNG restored).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS, MICRO, GAS, LR = 3, 2, 2, 1e-2

SCRIPT = """
import os, sys
import torch.distributed as dist
root, rank, second_tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, ".pg"), rank=rank, world_size=2)
import torch
from ds_strategy.runtime.checkpoint.pipe_files import pipe_state_dict
from tests.runtime.test_pipe_checkpoint_kill import build, train
engine, batches = build()
train(engine, batches[:1])
engine.save_checkpoint(root, tag="A")
if rank == 0:
    torch.save(pipe_state_dict(root, "A"), os.path.join(root, "reference.pt"))
dist.barrier()
os.environ["DS_STRATEGY_CKPT_TEST_PAUSE"] = "3"  # the kill lands within these 3 s
train(engine, batches[1:2])
engine.save_checkpoint(root, tag=second_tag)
print("ds_strategy-test: the save finished", file=sys.stderr, flush=True)
"""

MOMENTS = {  # name: (tag of the second save, rank 0's announcement to kill at)
    "shard": ("B", "writing pipe_rank_00000_states.pt"),
    "latest": ("B", "writing latest"),
    "swap": ("A", "writing A (between renames)"),
}


def specs() -> list[Any]:
    from tests.runtime.pipe_common import specs as tied_specs

    layers = tied_specs()
    return [*layers[:3], nn.Dropout(0.2), *layers[3:]]  # dropout on stage 0: its RNG state matters


def build(seed: int = 0) -> tuple[Any, list[Any]]:
    import ds_strategy
    from ds_strategy.pipe import PipelineModule
    from tests.runtime.pipe_common import data, pipe_config

    torch.manual_seed(seed)  # the layers are built from the global RNG (seed_layers=False): a resume's differ
    module = PipelineModule(specs(), num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, _, _, _ = ds_strategy.initialize(model=module, config=pipe_config(micro=MICRO, gas=GAS, lr=LR, clip=0.05))
    return engine, data(STEPS, 1, GAS, MICRO)


def train(engine: Any, batches: list[Any]) -> list[float]:
    return [float(engine.train_batch(iter(step[0]))) for step in batches]


def _uninterrupted(rank: int, world: int) -> list[float]:
    engine, batches = build()
    losses = train(engine, batches)
    engine.destroy()
    return losses


def _resume(rank: int, world: int, roots: list[str]) -> list[dict[str, Any]]:
    out = []
    for root in roots:
        engine, batches = build(seed=99)
        tag_dir, _ = engine.load_checkpoint(root)
        out.append({"tag_dir": Path(tag_dir).name, "step": engine.global_steps, "losses": train(engine, batches[1:])})
        engine.destroy()
    return out


def _start(root: Path, tag: str) -> list[subprocess.Popen[str]]:
    root.mkdir()
    script = root.parent / f"{root.name}.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}", "DS_STRATEGY_LOG_LEVEL": "WARNING"}
    procs = []
    for rank in (0, 1):
        err = subprocess.PIPE if rank == 0 else open(root.parent / f"{root.name}.rank1.err", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(root), str(rank), tag], stderr=err, text=True, env=env, cwd=REPO
            )
        )
    return procs


def _kill_at(procs: list[subprocess.Popen[str]], marker: str, timeout: float = 240) -> None:
    first = procs[0]
    assert first.stderr is not None
    deadline = time.monotonic() + timeout
    seen = []
    try:
        for line in first.stderr:
            seen.append(line)
            if marker in line:
                for p in procs:
                    os.kill(p.pid, signal.SIGKILL)
                return
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"never saw {marker!r}; rank 0 printed:\n{''.join(seen[-40:])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_sigkill_mid_save_keeps_the_previous_tag_and_the_run_resumes_bit_exactly(tmp_path: Path) -> None:
    from ds_strategy.runtime.checkpoint.pipe_files import pipe_state_dict

    for name, (tag, marker) in MOMENTS.items():  # one at a time: two processes each
        _kill_at(_start(tmp_path / name, tag), marker)
    for name in MOMENTS:
        root = tmp_path / name
        assert (root / "latest").read_text() == "A", name
        reference = torch.load(root / "reference.pt", weights_only=True)
        restored = pipe_state_dict(root)
        assert restored.keys() == reference.keys(), name
        assert all(torch.equal(restored[k], reference[k]) for k in reference), name
    # what each kill left behind: a staging directory (never loaded), a complete B, the old A set aside
    assert (tmp_path / "shard" / ".B.partial").is_dir() and not (tmp_path / "shard" / "B").exists()
    assert (tmp_path / "latest" / "B" / "pipe_meta.pt").is_file()
    assert not (tmp_path / "swap" / "A").exists() and (tmp_path / "swap" / ".A.replaced" / "pipe_meta.pt").is_file()

    expected = run_distributed(_uninterrupted, world_size=2, timeout=180)
    assert expected[0] == expected[1] and len(expected[0]) == STEPS
    roots = [str(tmp_path / name) for name in MOMENTS]
    for rank, resumed in enumerate(run_distributed(_resume, world_size=2, args=(roots,), timeout=240)):
        for name, r in zip(MOMENTS, resumed, strict=True):
            assert r["step"] == 1, (rank, name, r)
            assert r["tag_dir"] == (".A.replaced" if name == "swap" else "A"), (rank, name, r)
            assert r["losses"] == expected[rank][1:], (rank, name, r["losses"], expected[rank])
