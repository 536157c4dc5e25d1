"""Count ranks that abort at exit after a successful run (issue 43, criterion 3).

    python benchmarks/exit_aborts.py --launches 200            # each script 200 times, one launch at a time
    python benchmarks/exit_aborts.py --launches 20 --snapshot  # run a copy of src/ (edits meanwhile do not count)

Launches /work/shared/repro/exit_abort.py (or ``--repro``) and tests/comm/scripts/uneven_exit.py under
torchrun with 2 processes, alternating, one launch at a time (2 processes on the machine). uneven_exit.py
cycles through the cases of tests/comm/test_clean_exit.py with the late rank alternating. A launch counts
as an abort when a rank died of SIGABRT or printed "terminate called without an active exception"; any
other non-zero launch is counted as a failure apart (exit 3: a gloo thread outlived the package's exit
handler). The results are rewritten after every launch: benchmarks/results/exit_aborts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPRO = Path("/work/shared/repro/exit_abort.py")
UNEVEN = ROOT / "tests" / "comm" / "scripts" / "uneven_exit.py"
# (KIND, STAGE, PREC, OFFLOAD), as in tests/comm/test_clean_exit.py
CASES = [
    ("engine", 1, "bf16", "cpu"),
    ("engine", 3, "bf16", "cpu"),
    ("engine", 0, "fp32", "none"),
    ("engine", 2, "bf16", "none"),
    ("usergroup", 2, "fp32", "cpu"),
    ("selfdestroy", 1, "fp32", "none"),
    ("checkpoint", 3, "fp32", "none"),
    ("lightning", 3, "fp32", "none"),
]
ABORT_TEXT = "terminate called without an active exception"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _snapshot() -> Path:
    """A copy of src/ and csrc/ (same layout: the kernel cache key is the same), first on PYTHONPATH."""
    where = Path(tempfile.mkdtemp(prefix="exit_aborts_src_"))
    shutil.copytree(ROOT / "src", where / "src", ignore=shutil.ignore_patterns("__pycache__"))
    if (ROOT / "csrc").is_dir():
        shutil.copytree(ROOT / "csrc", where / "csrc")
    return where / "src"


def _launch(script: Path, env: dict[str, str], cwd: Path, timeout: float) -> dict[str, object]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), str(script)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = -999, f"timed out after {timeout}s: {err}"
    aborted = ABORT_TEXT in out or "Signal 6 (SIGABRT)" in out or "exitcode  : -6" in out
    return {"rc": rc, "abort": aborted, "seconds": round(time.perf_counter() - start, 2), "tail": out[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=200, help="launches of each script")
    parser.add_argument("--repro", type=Path, default=REPRO)
    parser.add_argument("--snapshot", action="store_true", help="run a copy of src/ taken at start")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "working tree"
    if args.snapshot:
        src = _snapshot()
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        code = f"snapshot of src/ at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    scripts = {"exit_abort.py": args.repro, "uneven_exit.py": UNEVEN}
    stats: dict[str, dict[str, object]] = {
        name: {"launches": 0, "aborts": 0, "other_failures": 0, "seconds": [], "failures": []} for name in scripts
    }
    work = Path(tempfile.mkdtemp(prefix="exit_aborts_"))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    for i in range(args.launches):
        for name, script in scripts.items():
            run_env = dict(env)
            label = name
            if name == "uneven_exit.py":
                kind, stage, prec, offload = CASES[i % len(CASES)]
                late = (i // len(CASES)) % 2
                run_env.update(KIND=kind, STAGE=str(stage), PREC=prec, OFFLOAD=offload, LATE=str(late))
                run_env.update(SECONDS_LATE="1.0", CKPT_DIR=str(work / f"ckpt{i}"))
                label = f"{name} {kind} stage {stage} {prec} offload={offload} late={late}"
            result = _launch(script, run_env, work, args.timeout)
            s = stats[name]
            s["launches"] = int(s["launches"]) + 1  # type: ignore[call-overload]
            s["seconds"].append(result["seconds"])  # type: ignore[attr-defined]
            if result["abort"]:
                s["aborts"] = int(s["aborts"]) + 1  # type: ignore[call-overload]
            elif result["rc"] != 0:
                s["other_failures"] = int(s["other_failures"]) + 1  # type: ignore[call-overload]
            if result["abort"] or result["rc"] != 0:
                s["failures"].append({"launch": i, "label": label, **result})  # type: ignore[attr-defined]
                print(f"launch {i} {label}: rc={result['rc']} abort={result['abort']}", flush=True)
        _write(args.out, stats, code, commit.stdout.strip(), args.launches, time.time() - started)
    shutil.rmtree(work, ignore_errors=True)


def _write(out: Path, stats: dict[str, dict[str, object]], code: str, commit: str, planned: int, wall: float) -> None:
    summary = {
        "planned_launches_each": planned,
        "code": code,
        "commit": commit,
        "processes_per_launch": 2,
        "wall_seconds": round(wall, 1),
        "scripts": {
            name: {
                "launches": s["launches"],
                "aborts": s["aborts"],
                "other_failures": s["other_failures"],
                "median_launch_seconds": sorted(s["seconds"])[len(s["seconds"]) // 2] if s["seconds"] else None,  # type: ignore[arg-type, index]
                "failures": s["failures"],
            }
            for name, s in stats.items()
        },
    }
    (out / "exit_aborts.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# Aborts at exit (issue 43, criterion 3)",
        "",
        f"Code: {code} (HEAD {commit}); torchrun, 2 processes per launch, one launch at a time; "
        f"{wall / 60:.0f} min. Written by benchmarks/exit_aborts.py.",
        "",
        "| script | launches | aborts (SIGABRT) | other failures | median launch (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in summary["scripts"].items():  # type: ignore[union-attr]
        lines.append(
            f"| {name} | {s['launches']} of {planned} | {s['aborts']} | {s['other_failures']} | "
            f"{s['median_launch_seconds']} |"
        )
    (out / "exit_aborts.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
