"""Smoke test of the benchmark suite (``nox -s bench``): ``python -m benchmarks.run_all --quick`` into a
temporary folder (never the committed benchmarks/results) writes every benchmark's JSON, markdown table and
PNG plus the summary, every peer that is installed ran, and the files parse."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from benchmarks.run_all import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.kernels
def test_run_all_quick_writes_every_result(tmp_path: Path, cpu_kernels: bool) -> None:
    committed = {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").glob("*")}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run_all", "--quick", "--results", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "wall time:" in proc.stdout, proc.stdout[-2000:]

    for name in BENCHMARKS:
        payload = json.loads((tmp_path / f"{name}.json").read_text())
        assert payload["machine"]["cores"] >= 1, name
        assert "|---|" in (tmp_path / f"{name}.md").read_text(), name
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG, name

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quick"] is True and summary["machine"]["cores"] >= 1
    assert list(summary["benchmarks"]) == list(BENCHMARKS)
    for name, entry in summary["benchmarks"].items():
        assert "error" not in entry and entry["headlines"] and entry["wall_s"] > 0, (name, entry)
    text = (tmp_path / "summary.md").read_text()
    assert all(f"## {name} " in text for name in BENCHMARKS), text

    # bench_sequence_parallel (issue 45, criterion 5): sp 1 and 2, the tiled loss and stage 2 beside each, the
    # step time at sp 2 with its all-to-all share (DeepSpeed's DistributedAttention beside ours where installed).
    seq = json.loads((tmp_path / "sequence_parallel.json").read_text())
    assert [s["sp"] for s in seq["memory"]] == [1, 2] and seq["longest_under_cap"] == {"1": 512, "2": 512}
    for s in seq["memory"]:
        assert all(r["peak"] > s["base"] > 0 for r in s["rows"] + s["tiled"]), s
        assert s["stage2"]["held"] > s["stage3_held"] > 0, s
    (timed,) = seq["step_time"]  # 8 exchanges: 2 layers x (query/key/value together, output) x forward, backward
    ours = timed["impls"]["ds_strategy"]
    assert timed["sp"] == 2 and 0 < ours["a2a_share"] < 1 and ours["a2a_calls"] == 8, timed
    if importlib.util.find_spec("deepspeed"):
        assert timed["first_loss"]["deepspeed"] == pytest.approx(timed["first_loss"]["ds_strategy"], rel=1e-5)

    e2e = json.loads((tmp_path / "e2e.json").read_text())
    ran = {r["case"] for r in e2e["cases"] if "error" not in r}
    assert [r for r in e2e["cases"] if "error" in r] == []
    expected = {"torch DDP", "torch FSDP2", "ds_strategy stage 0", "ds_strategy stage 3 + offload"}
    if importlib.util.find_spec("deepspeed"):
        expected |= {"deepspeed stage 0", "deepspeed stage 2 + offload", "deepspeed stage 3 + offload"}
    assert expected <= ran, ran
    derived = e2e["derived"]
    assert derived["stage3_over_stage2_step"] > 0 and derived["paired_stage3_over_stage2_step"] > 0
    assert derived["theoretical_stage3_saving_bytes"] == 16 * e2e["params"] * (1 - 1 / e2e["world_size"])
    assert "stage3_rss_saving_fraction_of_theory" in derived

    # bench_zeropp: both convergence curves, every timing, and qwZ's int8 gathers moving about a quarter
    zeropp = json.loads((tmp_path / "zeropp.json").read_text())
    assert all("losses" in c for c in zeropp["convergence"]["cases"].values()), zeropp["convergence"]
    assert [t for t in zeropp["timings"] if "error" in t] == []
    qwz = next(t for t in zeropp["timings"] if t["option"] == "qwZ")
    base = next(t for t in zeropp["timings"] if t["option"] == "stage 3")
    assert qwz["bytes"]["all_gather@2"] < 0.3 * base["bytes"]["all_gather@2"]

    # bench_pipeline: every row ran, and the link was timed on both transports
    pipeline = json.loads((tmp_path / "pipeline.json").read_text())
    assert [r for r in pipeline["rows"] if "error" in r] == []
    assert {r["engine"] for r in pipeline["rows"]} >= {"ds_strategy", "ds_strategy (process group)"}
    assert {e["transport"] for e in pipeline["p2p"] if e.get("one_way_s", 0) > 0} == {"shm", "process group"}

    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    assert [r for r in checkpoint["cases"] if "error" in r] == []
    assert {(r["peer"], r["stage"]) for r in checkpoint["cases"]} >= {("ds_strategy", s) for s in (1, 2, 3)}

    nvme = json.loads((tmp_path / "nvme.json").read_text())
    ours = {k: c for k, c in nvme["cases"].items() if "ds_strategy" in k}
    assert len(ours) == 6 and all("error" not in c for c in ours.values()), ours
    assert all(c["swap_bytes_per_rank"] > 0 for k, c in ours.items() if "nvme" in k)
    assert {"ds_strategy nvme", "ds_strategy cpu"} <= set(nvme["derived"])

    compiled = json.loads((tmp_path / "compile.json").read_text())
    assert [r for r in compiled["cases"] if "error" in r] == []
    assert compiled["backend"] == "aot_eager" and compiled["derived"]["stage2_compiled_over_ddp_compiled"] > 0
    assert all("compile_s" in r for r in compiled["cases"] if r["case"].endswith("compiled"))

    # bench_aio (16 MiB in --quick): every compiled backend, fio and DeepSpeed's handle where installed, the queue
    # depth kept in flight
    payload = json.loads((tmp_path / "aio.json").read_text())
    engines = {(r["engine"], r["io"]) for r in payload["cases"]}
    from ds_strategy.ops.aio import compiled_backends

    assert {io for engine, io in engines if engine == "ours"} == set(compiled_backends()), engines
    assert ("plain sequential", "-") in engines and {r["depth"] for r in payload["cases"]} == {None, 1, 8}
    if shutil.which("fio"):
        assert {("fio", "libaio"), ("fio", "io_uring")} <= engines, engines
    if importlib.util.find_spec("deepspeed"):
        assert ("DeepSpeed aio_handle", "libaio") in engines or "DeepSpeed aio_handle" in payload["skipped"]
    assert all(r["write_gbps"] > 0 and r["overwrite_gbps"] > 0 and r["read_gbps"] > 0 for r in payload["cases"])
    # io_uring and libaio keep the queue depth in flight (as many blocks as the file has, at most); the
    # blocking path one request at a time
    blocks = payload["bytes"] // payload["block_size"]
    depth = {(r["io"], r["depth"]): r["device_max_in_flight"] for r in payload["cases"] if r["engine"] == "ours"}
    assert all(n == (min(d, blocks) if io != "blocking" else 1) for (io, d), n in depth.items()), depth
    assert "| plain sequential" in (tmp_path / "aio.md").read_text()
    assert (tmp_path / "aio.png").read_bytes()[:8] == PNG
    from benchmarks.bench_aio import headlines

    assert any("qd 8" in figure for figure, _ in headlines(payload))

    after = {p: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").glob("*")}
    assert after == committed, "the smoke run touched the committed results"
    print(f"run_all --quick: {wall:.0f} s")


def _bench_env(results: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "DS_STRATEGY_BENCH_RESULTS": str(results),
        "DS_STRATEGY_BENCH_FORKSERVER": "1",  # smoke runs: ranks forked, not spawned (benchmarks/common.py)
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_e2e_device_cuda_refuses_at_once_without_a_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_e2e", "--device", "cuda"],
        cwd=ROOT, env=_bench_env(tmp_path), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bench_e2e --device cuda: no CUDA device here" in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


@pytest.mark.slow
@pytest.mark.multiprocess
def test_e2e_cuda_pipeline_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/e2e_cuda.py's plumbing (a fresh process per case, timing, records, table, JSON, PNG) with
    the CPU in place of the GPU: what --device cuda runs, short of the CUDA calls. The results are written
    after every case (a run stopped by a time limit keeps what it finished), marked partial until the end."""
    script = (
        "import json\n"
        "from benchmarks import e2e_cuda\n"
        "writes, write = [], e2e_cuda.write_results\n"
        "def spy(name, payload, text):\n"
        "    writes.append([len(payload['cases']), 'Partial' in text])\n"
        "    write(name, payload, text)\n"
        "e2e_cuda.write_results = spy\n"
        "if __name__ == '__main__':\n"
        "    e2e_cuda.main(True, {'torch FSDP2', 'ds_strategy stage 3'}, 'e2e_cuda', device='cpu')\n"
        "    print('WRITES', json.dumps(writes))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT, env=_bench_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    writes = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("WRITES "))[7:])
    assert writes == [[1, True], [2, False], [2, False]], writes
    payload = json.loads((tmp_path / "e2e_cuda.json").read_text())
    assert payload["device"] == "cpu" and payload["world_size"] == 1 and payload["params"] > 0
    cases = {r["case"]: r for r in payload["cases"]}
    assert set(cases) == {"torch FSDP2", "ds_strategy stage 3"}, cases
    for r in cases.values():
        assert "error" not in r and r["seconds_per_step"] > 0 and r["peak_allocated"] > 0, r
    text = (tmp_path / "e2e_cuda.md").read_text()
    assert "| ds_strategy stage 3 |" in text and "step vs FSDP2" in text
    assert (tmp_path / "e2e_cuda.png").read_bytes()[:8] == PNG


def test_deepspeed_gets_an_arch_list_it_can_parse() -> None:
    """DeepSpeed's JIT builder failed on the H200 machine's "9.0a" (2026-11-26); plain lists pass through."""
    from benchmarks.e2e_cuda import arch_list_for_deepspeed

    assert arch_list_for_deepspeed("9.0a", (9, 0)) == "9.0"
    assert arch_list_for_deepspeed("8.0;9.0a", (9, 0)) == "9.0"
    assert arch_list_for_deepspeed("8.0 9.0+PTX", (9, 0)) is None
    assert arch_list_for_deepspeed("9.0", (9, 0)) is None
    assert arch_list_for_deepspeed(None, (9, 0)) is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hybrid_one_rank_pipeline_on_the_cpu(tmp_path: Path) -> None:
    """bench_hybrid --device cuda's plumbing (one rank, the device's synchronisation, the device in the
    records and table) with the CPU in place of the GPU; and --device cuda refuses at once without a GPU."""
    script = (
        "from benchmarks import bench_hybrid\n"
        "if __name__ == '__main__':\n"
        "    p = bench_hybrid.run(True, 'cpu', world=1)\n"
        "    print(bench_hybrid.table(p))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT, env=_bench_env(tmp_path), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "1 CPU rank," in proc.stdout and "| torch DDP |" in proc.stdout, proc.stdout[-2000:]
    assert "failed" not in proc.stdout and "| NO |" not in proc.stdout, proc.stdout[-2000:]  # tokens equal DDP's
    if not torch.cuda.is_available():
        refused = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_hybrid", "--device", "cuda"],
            cwd=ROOT, env=_bench_env(tmp_path), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert refused.returncode == 2 and "no CUDA device here" in refused.stderr, refused.stderr
        assert not list(tmp_path.glob("hybrid_cuda*"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero3_gpu_and_fetch_cost_plumbing_on_the_cpu(tmp_path: Path) -> None:
    """bench_zero3_gpu (through Lightning, world 1 and a fake group of 8) and bench_fetch_cost, tiny runs on the
    CPU: the tables and files are written, the fake case is rank 0 of 8, stage 3 gathers once per block."""
    runs = [
        [
            "benchmarks.bench_zero3_gpu",
            "--device",
            "cpu",
            "--quick",
            "--only",
            "zero3,zero3 fake-8",
            "--steps",
            "9",
            "--sample",
        ],
        ["benchmarks.bench_fetch_cost", "--worlds", "8", "--cases", "plain,zero3", "--steps", "3"],
    ]
    for args in runs:
        proc = subprocess.run(
            [sys.executable, "-m", *args], cwd=ROOT, env=_bench_env(tmp_path), capture_output=True, text=True,
            timeout=600, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    cases = {r["case"]: r for r in json.loads((tmp_path / "zero3_cpu.json").read_text())["cases"]}
    assert cases["zero3"]["world_size"] == 1 and cases["zero3 fake-8"]["world_size"] == 8, cases
    layers = 4  # CPU_SHAPE: 4 blocks, each one unit, plus the rest
    for case in cases.values():
        assert case["fetch_units"] == layers + 1 and 0 < case["gathers_per_step"] <= 2 * layers + 4, case
    fetch = json.loads((tmp_path / "fetch_cost.json").read_text())["records"]
    assert {r["case"] for r in fetch} == {"plain", "zero3"} and all("ms" in r for r in fetch), fetch
    assert all(r["spread"] >= 1 and r["full_gc_passes"] >= 0 for r in fetch), fetch  # the steps' spread, GC passes
    assert (tmp_path / "zero3_cpu.png").exists() and (tmp_path / "fetch_cost.md").exists()
    for case in cases.values():  # steps 5, 6 sampled (not timed), 7 and 8 timed: per-step costs of every step
        assert len(case["ms_steps"]) == 9 - 2 and len(case["host_ms_steps"]) == len(case["gc_ms_steps"]) == 9, case
    stacks = (tmp_path / "zero3_cpu_stacks_zero3_fake8.txt").read_text()
    assert "== MainThread" in stacks and "-- inclusive, every frame of ds_strategy --" in stacks, stacks[:2000]


FORKSERVER_PROBE = """
import os, sys
import torch
from benchmarks.common import environment, run_ranks


def probe(rank, world):
    with open("/proc/self/environ", "rb") as f:  # what the process started with (exec), not os.environ
        at_start = dict(kv.split(b"=", 1) for kv in f.read().split(b"\\0") if b"=" in kv)
    return [os.environ.get("PROBE"), at_start.get(b"MALLOC_PERTURB_", b"").decode(), os.environ["RANK"],
            torch.get_num_threads(), os.getppid()]


if __name__ == "__main__":
    os.environ["PROBE"] = "first"
    first = run_ranks(probe, 2)
    os.environ["PROBE"] = "second"  # set after the forkserver started: the ranks still see it
    second = run_ranks(probe, 2)
    with environment({"MALLOC_PERTURB_": "165"}):  # only a fresh process takes it: these ranks are spawned
        third = run_ranks(probe, 2)
    print(first, second, third, os.getpid(), sep="\\n")
"""


def test_smoke_runs_fork_ranks_with_the_callers_environment_and_spawn_for_start_time_variables(
    tmp_path: Path,
) -> None:
    """benchmarks/common.py run_ranks under DS_STRATEGY_BENCH_FORKSERVER=1: ranks forked from one server
    (same parent twice) see the caller's variables as they are now; a glibc tunable set for the ranks (which
    a forked process could not take) makes them spawned, where it is in effect from the start."""
    (tmp_path / "probe.py").write_text(FORKSERVER_PROBE)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py")], cwd=ROOT, env=_bench_env(tmp_path), capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    first, second, third, parent = (eval(line) for line in proc.stdout.strip().splitlines()[-4:])
    assert [r[:4] for r in first] == [["first", "", "0", 1], ["first", "", "1", 1]], first
    assert [r[:4] for r in second] == [["second", "", "0", 1], ["second", "", "1", 1]], second
    server = {r[4] for r in first + second}
    assert len(server) == 1 and server != {parent}, (server, parent)  # forked by one forkserver
    assert [r[:3] for r in third] == [["second", "165", "0"], ["second", "165", "1"]], third
    assert {r[4] for r in third} == {parent}, third  # spawned by the caller itself


def test_stack_sampler_sees_every_thread() -> None:
    """benchmarks/stack_sampler.py: a thread busy in a function is found there, with its callers inclusive."""
    import threading
    import time

    from benchmarks.stack_sampler import StackSampler

    def spin_in_worker(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def outer_caller() -> None:
        spin_in_worker(0.3)

    with StackSampler(interval=0.002) as sampler:
        worker = threading.Thread(target=outer_caller, name="busy-worker")
        worker.start()
        worker.join()
    report = sampler.report(top=10, focus="test_benchmarks")
    assert "== busy-worker" in report and "test_benchmarks.py:spin_in_worker" in report, report
    section = report.split("== busy-worker")[1].split("\n== ")[0]  # other threads (a pool feeder) may come first
    assert "test_benchmarks.py:outer_caller" in section.split("-- inclusive")[1], report


@pytest.mark.slow
@pytest.mark.multiprocess
def test_autotune_quick_writes_its_results(tmp_path: Path) -> None:
    """bench_autotune at smoke size (issue 44, criterion 6): the tune and the exhaustive search of the Hugging
    Face model (the GPT takes the same path with another builder: left out to keep the suite's time), the
    fresh interleaved reruns, the cap case, and the table, JSON and plot."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_autotune", "--quick", "--models", "llama"],
        cwd=ROOT, env=_bench_env(tmp_path), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    payload = json.loads((tmp_path / "autotune.json").read_text())
    assert payload["quick"] is True and payload["machine"]["cores"] >= 1
    models = {m["model"]: m for m in payload["models"]}
    assert set(models) == {"llama"} and all("error" not in m for m in models.values()), models
    for m in models.values():
        tune, grid = m["tune"], m["exhaustive"]
        assert grid["trials_run"] == grid["candidates"] - grid["pruned"] > 0, grid  # every candidate ran
        assert 0 < tune["trials_run"] <= grid["trials_run"] and tune["best"] and grid["best"], tune
        assert m["ratio_in_trial"] > 0 and 0 < m["ratio_in_exhaustive"] <= 1
        assert m["fresh"]["same_configuration"] or m["fresh"]["ratio"] > 0, m["fresh"]
        assert "skipped" in m["cap"] or m["cap"]["tune"]["memory_cap_bytes"] == m["cap"]["cap_bytes"], m["cap"]
    assert "| tune: winner |" in (tmp_path / "autotune.md").read_text()
    assert (tmp_path / "autotune.png").read_bytes()[:8] == PNG
    from benchmarks.bench_autotune import headlines

    assert len(headlines(payload)) == 2 * len(models)


def test_e2e_repeat_reports_each_cases_median_over_the_rounds_and_keeps_every_round() -> None:
    """``bench_e2e --repeat N``: one disturbed round moves no figure; a case that failed in any round is
    reported as failed, not as the median of the rounds it survived."""
    from benchmarks.bench_e2e import merge_rounds

    def rec(case: str, s: float, rss: int) -> dict:
        return {"case": case, "peer": "torch DDP", "stage": 0, "offload": False, "seconds_per_step": s, "peak_rss": rss}

    rounds = [
        [rec("a", 2.5, 10), rec("b", 1.0, 5)],
        [rec("a", 4.7, 12), {"case": "b", "error": "rank 1 died"}],
        [rec("a", 2.6, 11), rec("b", 1.1, 6)],
    ]
    a, b = merge_rounds(rounds)
    assert a["seconds_per_step"] == 2.6 and a["peak_rss"] == 11
    assert [r["seconds_per_step"] for r in a["rounds"]] == [2.5, 4.7, 2.6]
    assert b == {"case": "b", "error": "rank 1 died"}
    assert merge_rounds([[rec("a", 3.0, 7)]])[0]["seconds_per_step"] == 3.0
