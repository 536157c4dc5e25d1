"""Sessions for ds_strategy: `nox -l` lists them, `nox -s tests` runs the whole suite.

Every session installs torch==2.13.0 (a CPU build where the index has one) so that an unpinned torch
does not pull a multi-GB CUDA build. Ask for another build with DS_STRATEGY_TORCH, e.g.
``DS_STRATEGY_TORCH="torch==2.5.1" nox -s tests`` or, for CUDA wheels,
``DS_STRATEGY_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"

TORCH = shlex.split(os.environ.get("DS_STRATEGY_TORCH", "torch==2.13.0"))
DEEPSPEED = os.environ.get("DS_STRATEGY_DEEPSPEED", "deepspeed==0.19.8")  # the bench session's yardstick
SOURCES = ["src", "tests", "benchmarks", "examples", "noxfile.py", "setup.py"]


def _install(session: nox.Session, extras: str = "") -> None:
    session.install(*TORCH)
    session.install(f".{extras}")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the whole test suite (unit, kernels, multi-process, Lightning) on this machine's CPU: on two
    pytest-xdist workers, then the ``serial`` tests alone; ``DS_STRATEGY_TEST_WORKERS=1``: in one process."""
    _install(session, "[test]")
    session.run("python", "-m", "ds_strategy.ops", "build")  # one warm kernel cache for every test process
    env = {"DS_STRATEGY_REQUIRE_KERNELS": "1"}
    pytest = ["python", "-m", "pytest", "tests", "-q"]
    workers = os.environ.get("DS_STRATEGY_TEST_WORKERS", "2")
    if workers in ("0", "1"):
        session.run(*pytest, "--durations=40", *session.posargs, env=env)
        return
    # Two phases: the suite on `workers` pytest-xdist workers (slow tests first, tests/conftest.py), then the
    # tests marked `serial` alone, since they time a call or a thread's share of the CPU. A selection in
    # posargs may leave either phase empty (pytest's exit code 5).
    maybe_empty = [0, 5] if session.posargs else [0]
    session.run(
        *pytest, "-n", workers, "--dist", "load", "-m", "not serial", "--durations=40", *session.posargs,
        env=env, success_codes=maybe_empty,
    )  # fmt: skip
    session.run(*pytest, "-m", "serial", *session.posargs, env=env, success_codes=[0, 5])


CUDA_SUITE = ["tests/cuda", "tests/ops/test_fused_adam_cuda.py", "tests/ops/test_quant_cuda.py"]


def _gpu_listed() -> str:
    """What ``nvidia-smi -L`` lists (empty without a driver or a GPU): checked before anything is installed,
    so a machine without a GPU never downloads torch for this session."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 and "GPU" in out.stdout else ""


@nox.session
def cuda(session: nox.Session) -> None:
    """The CUDA suite on this machine's GPU (docs/gpu.md): stages 0-3 +- offload against torch on the GPU,
    zero.Init, Lightning on ``accelerator="gpu"``, FusedAdam and the norm kernel. Skips where there is no GPU.

    torch comes from DS_STRATEGY_TORCH like every session (PyPI's torch for Linux x86-64 is a CUDA build; for
    another CUDA version name its index, e.g. ``DS_STRATEGY_TORCH="torch==2.13.0 --index-url
    https://download.pytorch.org/whl/cu128"``)."""
    listed = _gpu_listed()
    if not listed:
        session.skip("no CUDA device here (nvidia-smi is missing or lists no GPU): the CUDA suite needs one")
    session.log(listed)
    _install(session, "[test]")
    probe = "import torch; print(torch.cuda.is_available(), torch.__version__, torch.version.cuda)"
    out = str(session.run("python", "-c", probe, silent=True) or "").split()
    if not out or out[0] != "True":
        version = " ".join(out[1:]) or "unknown"
        session.skip(
            f"this session's torch ({version}) sees no CUDA device: set DS_STRATEGY_TORCH to a CUDA build of torch"
        )
    session.run("python", "-m", "ds_strategy.ops", "build")  # CPU and CUDA kernels, before any test times out
    session.run(
        "python", "-m", "pytest", *CUDA_SUITE, "-q", "-rs", *session.posargs, env={"DS_STRATEGY_REQUIRE_KERNELS": "1"}
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: zero3 beside zero2 and DDP on 2 CPU processes, table, PNG, checkpoint (docs/demo.md)."""
    _install(session, "[docs]")
    session.run("python", "-m", "ds_strategy.demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark beside its peers (torch DDP / FSDP2 / optimizers, DeepSpeed) in one run; results in
    benchmarks/results/ (JSON, markdown, PNG, summary.md). ``nox -s bench -- --quick`` is the smoke run.

    DeepSpeed is installed as the yardstick (DS_STRATEGY_DEEPSPEED, default deepspeed==0.19.8; its ops are
    JIT-built on first use, for its CPU accelerator); DS_STRATEGY_BENCH_DEEPSPEED=0 leaves it out (its
    columns are then absent; a .nox/bench that already has it needs ``--reuse-venv=no`` once)."""
    _install(session, "[bench]")
    if os.environ.get("DS_STRATEGY_BENCH_DEEPSPEED", "1") != "0":
        # --no-build-isolation: its setup.py imports torch (the pinned one above); DS_BUILD_OPS=0: no
        # ahead-of-time CUDA ops, the CPU ones are JIT-built by the benchmarks.
        session.install("setuptools", "wheel")
        session.install("--no-build-isolation", DEEPSPEED, env={"DS_BUILD_OPS": "0"})
    session.run("python", "-m", "ds_strategy.ops", "build")  # kernel build time stays out of the timings
    # The benchmarks measure CPU training: DeepSpeed must pick its CPU accelerator (benchmarks/__init__.py
    # sets it as well, for runs outside nox).
    session.run("python", "-m", "benchmarks.run_all", *session.posargs, env={"DS_ACCELERATOR": "cpu"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the sources, tests, benchmarks and build files."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", *SOURCES)
    session.run("ruff", "format", "--check", *SOURCES)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy (strict about untyped defs) on src/ds_strategy."""
    _install(session, "[lint]")
    session.run("mypy", "src/ds_strategy")
