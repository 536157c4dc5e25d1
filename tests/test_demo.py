"""The main job (``python -m ds_strategy.demo``): end to end in --quick mode, and its helpers one by one."""

from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from benchmarks.common import free_port

import ds_strategy
from ds_strategy.demo.__main__ import (
    CHECKPOINT,
    CONSOLIDATED,
    FLOPS_PROFILE,
    PLOT,
    QUICK,
    parse_args,
    plan_for,
    strip_prefix,
    weights_match,
)
from ds_strategy.demo.measure import (
    MIB,
    RunRecorder,
    RunResult,
    model_state_bytes,
    rank_memory,
    reset_peak_memory,
    summarize,
    tensor_state_bytes,
)
from ds_strategy.demo.model import GPT
from ds_strategy.demo.module import lr_factor
from ds_strategy.demo.report import comparison_table, last_loss, max_loss_gap, plot
from tests.harness import run_distributed

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------- end to end
def _own_processes(marker: str) -> list[int]:
    """Live processes whose command line mentions ``marker`` (the demo's unique --out directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    out, trained_path = tmp_path / "demo-out", tmp_path / "trained.pt"
    src = str(Path(ds_strategy.__file__).parents[1])  # this tree's package, in the demo's ranks too
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    env["STANDALONE_PORT"] = str(free_port())  # Lightning's launcher takes it: not a port a neighbour picks too
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_strategy.demo",
            "--quick",
            "--out",
            str(out),
            "--trained-weights",
            str(trained_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    wall = time.monotonic() - started
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    print(f"demo --quick: {wall:.1f} s")
    stdout = proc.stdout
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert not _own_processes(str(out)), "a rank of the demo outlived it"

    # one table row per strategy, from rank 0 only
    rows = {line.split("│")[1].strip(): line for line in stdout.splitlines() if line.startswith("│")}
    assert {"zero3", "zero2", "ddp"} <= rows.keys(), stdout
    assert stdout.count("│ zero3 ") == 1, stdout
    cells = [c.strip() for c in rows["zero3"].split("│")[1:-1]]
    assert cells[1] == str(QUICK.zero3_steps)
    assert cells[6].endswith("%") and 0 < float(cells[6][:-1]) < 100, cells  # MFU against the measured core
    peaks = [float(v.replace(",", "")) for v in cells[8].split("/")]
    assert len(peaks) == 2 and all(50 < p < 10_000 for p in peaks), cells  # MiB: measured, one per rank
    states = {name: [float(v) for v in row.split("│")[8].split("/")] for name, row in rows.items()}
    assert all(0 < s < 1 for s in states["ddp"]), states  # a 0.02M-parameter model: well under 1 MiB
    # ZeRO partitions what DDP replicates (stage 3 keeps parameters this small whole: its persistence threshold)
    assert max(states["zero3"]) < min(states["ddp"]) and max(states["zero2"]) < min(states["ddp"]), states

    png = out / PLOT
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 400 and height > 200

    # the consolidated file loads into the bare model and holds exactly the trained zero3 weights
    assert (out / CHECKPOINT / "latest").is_file()
    state = strip_prefix(torch.load(out / CONSOLIDATED, weights_only=True))
    bare = GPT(QUICK.model)
    bare.load_state_dict(state, strict=True)
    trained = torch.load(trained_path, weights_only=True)
    assert trained.keys() == bare.state_dict().keys()
    for key, value in bare.state_dict().items():
        assert torch.equal(value, trained[key]), key
    # and the weights moved from their initial values (the run trained)
    torch.manual_seed(0)
    assert not torch.equal(GPT(QUICK.model).head.weight, bare.head.weight)
    assert "bit-identical" in stdout

    # the sample comes from engine.generate under the hybrid engine; its greedy tokens equal the bare GPT's
    assert "greedy tokens of the bare GPT vs engine.generate under the hybrid engine: 14, equal" in stdout
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("sample from engine.generate under the hybrid"))
    assert lines[at + 1].startswith("The ") and len(lines[at + 1]) > len("The ")
    assert "Flops profile at step 2" in (out / FLOPS_PROFILE).read_text()  # the engine's flops_profiler
    for name in (CHECKPOINT, CONSOLIDATED, PLOT, FLOPS_PROFILE):
        assert str(out / name) in stdout


# ---------------------------------------------------------------------------------------------- measuring
def test_summarize_means_losses_over_ranks_and_keeps_each_rank_memory() -> None:
    losses = torch.tensor([[4.0, 3.0, 2.0], [6.0, 5.0, 4.0]])
    stats = torch.tensor([[1000.0, 2.0, 300 * MIB, 200 * MIB, 7e6], [1000.0, 4.0, 500 * MIB, 210 * MIB, 8e6]])
    r = summarize("zero3", losses, stats)
    assert r.losses == [5.0, 4.0, 3.0] and r.steps == 3
    assert r.tokens_per_s == pytest.approx(2000 / 4.0)  # every rank's tokens over the slowest rank's time
    assert r.peak_rss == [300 * MIB, 500 * MIB] and r.setup_rss == [200 * MIB, 210 * MIB]
    assert r.state_bytes == [7_000_000, 8_000_000]
    with pytest.raises(ValueError, match="expected"):
        summarize("x", losses, stats[:1])


def test_rank_memory_sees_an_allocation_and_resets() -> None:
    gc.collect()  # an earlier test's garbage freed after the reset would lower RSS under the reset peak
    if not reset_peak_memory():
        pytest.skip("this platform cannot reset the peak RSS")
    rss_before, _ = rank_memory()
    # 64 MiB of fresh pages, touched: a tensor could reuse a block glibc kept resident from an earlier test
    # (seen in CI: RSS unchanged), a new anonymous mapping cannot.
    mapping = mmap.mmap(-1, 64 * MIB)
    block = torch.frombuffer(mapping, dtype=torch.uint8).fill_(1)
    rss, peak = rank_memory()
    assert rss >= rss_before + 60 * MIB and peak >= rss
    del block
    mapping.close()
    assert reset_peak_memory()
    rss, peak = rank_memory()
    assert peak < rss + 16 * MIB  # the mark restarted from the current RSS


def _record(rank: int, world: int, extra_mib: int) -> dict[str, Any]:
    """One rank drives a RunRecorder through a fake 3-step fit; rank 1 holds ``extra_mib`` more memory."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        return torch.stack(out)

    trainer = SimpleNamespace(
        max_steps=3,
        global_step=0,
        world_size=world,
        is_global_zero=rank == 0,
        strategy=SimpleNamespace(engine=None),
        lightning_module=torch.nn.Linear(4, 4),  # 20 fp32 parameters, no gradients: 80 bytes of model states
        optimizers=[],
    )
    rec = RunRecorder("fake", gather=gather)
    rec.setup(trainer, None, "fit")  # type: ignore[arg-type]
    held = []
    for step in range(3):
        trainer.global_step = step
        rec.on_train_batch_start(trainer, None, None, step)  # type: ignore[arg-type]
        if rank == 1 and step == 1:
            held.append(torch.ones(extra_mib * MIB // 4))
        batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        rec.on_train_batch_end(trainer, None, {"loss": torch.tensor(float(rank + step))}, batch, step)  # type: ignore[arg-type]
    rec.on_train_end(trainer, None)  # type: ignore[arg-type]
    res = rec.result
    return {"result": None if res is None else vars(res), "resets": reset_peak_memory()}


@pytest.mark.multiprocess
def test_recorder_collects_each_rank_measured_memory_on_rank_zero() -> None:
    r0, r1 = run_distributed(_record, world_size=2, args=(96,), timeout=60)
    assert r1["result"] is None  # only rank 0 reports
    res = r0["result"]
    assert res["losses"] == [0.5, 1.5, 2.5]  # mean over ranks of (rank + step)
    if not r0["resets"]:
        pytest.skip("this platform cannot reset the peak RSS")
    growth = [p - s for p, s in zip(res["peak_rss"], res["setup_rss"], strict=True)]
    assert growth[1] >= 90 * MIB, growth  # rank 1's allocation, measured on rank 1
    assert growth[0] < growth[1] - 64 * MIB, growth  # and not assumed for rank 0
    assert res["tokens_per_s"] > 0
    assert res["state_bytes"] == [80, 80]


def test_model_state_bytes_counts_params_grads_and_optimizer_state() -> None:
    lin = torch.nn.Linear(10, 10)  # 110 parameters
    opt = torch.optim.Adam(lin.parameters())
    assert tensor_state_bytes(lin, [opt]) == 110 * 4
    lin(torch.ones(1, 10)).sum().backward()
    opt.step()  # + grads, exp_avg, exp_avg_sq (and two scalar `step` tensors)
    assert tensor_state_bytes(lin, [opt]) == 4 * 110 * 4 + 2 * 4
    engine = SimpleNamespace(memory_breakdown=lambda: {"params": 10, "grads": 20, "master": 0, "optimizer_state": 30})
    assert model_state_bytes(SimpleNamespace(strategy=SimpleNamespace(engine=engine))) == 60  # type: ignore[arg-type]
    trainer = SimpleNamespace(strategy=SimpleNamespace(), lightning_module=lin, optimizers=[opt])
    assert model_state_bytes(trainer) == tensor_state_bytes(lin, [opt])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- reporting
def _result(name: str, losses: list[float], peaks: tuple[int, int] = (400, 410)) -> RunResult:
    return RunResult(name, losses, 1234.0, [p * MIB for p in peaks], [3 * MIB, 3 * MIB // 2], [350 * MIB, 360 * MIB])


def test_table_has_a_row_per_strategy_with_the_gap_to_ddp() -> None:
    from rich.console import Console

    ddp = _result("ddp", [5.0, 4.0, 3.5])
    zero3 = _result("zero3", [5.0, 4.0, 3.5001] + [2.0] * 12, peaks=(380, 390))
    assert max_loss_gap(zero3, ddp) == pytest.approx(1e-4)
    assert last_loss(zero3) == pytest.approx(2.0)  # the mean of the last 10 steps
    console = Console(width=200, record=True)
    console.print(comparison_table([zero3, ddp]))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "zero3" in line)
    assert "15" in row and "1.0e-04" in row and "380 / 390" in row and "3.00 / 1.50" in row and "1,234" in row
    assert any("ddp" in line and " - " in line for line in text.splitlines())


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = plot([_result("zero3", [5.0, 4.0, 3.0]), _result("ddp", [5.0, 4.2])], tmp_path / "sub" / "p.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


# ---------------------------------------------------------------------------------------------- the rest
def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    assert lr_factor(0, 100) == pytest.approx(0.1)
    assert lr_factor(9, 100) == pytest.approx(1.0)
    assert lr_factor(10, 100) == pytest.approx(1.0)
    assert lr_factor(100, 100) == pytest.approx(0.1) and lr_factor(500, 100) == pytest.approx(0.1)
    assert lr_factor(40, 100) > lr_factor(60, 100)


def test_weights_match_and_strip_prefix() -> None:
    a = {"model.w": torch.ones(2), "model.b": torch.zeros(1)}
    assert strip_prefix(a).keys() == {"w", "b"}
    assert weights_match(a, {k: v.clone() for k, v in a.items()}) == (True, 0.0)
    same, gap = weights_match(a, {"model.w": torch.ones(2) + 1e-3, "model.b": torch.zeros(1)})
    assert not same and gap == pytest.approx(1e-3, rel=1e-3)
    assert weights_match(a, {"model.w": torch.ones(2)})[0] is False


def test_cli() -> None:
    args = parse_args(["--quick", "--steps", "5", "--devices", "2"])
    plan = plan_for(args)
    assert plan.zero3_steps == 5 and plan.brief_steps == QUICK.brief_steps and plan.model == QUICK.model
    assert plan_for(parse_args(["--steps", "7"])).brief_steps == 7  # brief runs never longer than the main one
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


def test_recorder_in_one_process_whatever_all_gather_returns() -> None:
    """Lightning's all_gather gives (1, ...) with a one-rank process group and the tensor itself without one."""
    for gather in (lambda t: t.unsqueeze(0), lambda t: t):
        trainer = SimpleNamespace(
            max_steps=2,
            global_step=0,
            world_size=1,
            is_global_zero=True,
            strategy=SimpleNamespace(engine=None),
            lightning_module=torch.nn.Linear(2, 2),
            optimizers=[],
        )
        rec = RunRecorder("one", gather=gather)
        rec.setup(trainer, None, "fit")  # type: ignore[arg-type]
        for step in range(2):
            trainer.global_step = step
            rec.on_train_batch_start(trainer, None, None, step)  # type: ignore[arg-type]
            batch = (torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
            rec.on_train_batch_end(trainer, None, torch.tensor(3.0 - step), batch, step)  # type: ignore[arg-type]
        rec.on_train_end(trainer, None)  # type: ignore[arg-type]
        assert rec.result is not None and rec.result.losses == [3.0, 2.0] and rec.result.state_bytes == [24]


def test_generate_with_the_key_value_cache_equals_full_recompute() -> None:
    """The cached decoding path (only the new token through each block) gives the tokens and logits of
    running the whole sequence again at every step, in several pieces of any length."""
    from ds_strategy.demo.model import GPTConfig, KVCache

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=48, n_layer=2, n_head=4, n_embd=32)).eval()
    prompt = torch.randint(0, 256, (3, 7))
    out = model.generate(prompt, 20, do_sample=False)
    expected = prompt
    with torch.no_grad():
        for _ in range(20):
            expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(out, expected)
        caches = [KVCache(30) for _ in model.blocks]
        pieces = [model(out[:, a:b], caches) for a, b in ((0, 5), (5, 6), (6, 26))]
        torch.testing.assert_close(torch.cat(pieces, dim=1), model(out[:, :26]), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="exceed its capacity"):
            model(out[:, :5], caches)
