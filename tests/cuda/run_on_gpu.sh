#!/usr/bin/env bash
# The CUDA suite and the GPU benchmark on a machine that has a CUDA build of torch, Lightning and pytest
# but no package index (docs/gpu.md). Nothing in the Python environment changes: the wheels brought in
# WHEELS (see tests/cuda/fetch_wheels.sh) that the environment lacks, and ds_strategy itself (without
# dependencies), go into DEPS, which is put first on PYTHONPATH.
#
#   tests/cuda/run_on_gpu.sh [OUTPUT_DIR]            # default: $OUT if set, else ./gpu-results
#   tests/cuda/run_on_gpu.sh --install-only [DIR]    # only the install step and its import check
#
# Environment: PYTHON (default python3), WHEELS (default .whl/), DEPS (default .gpu-deps/, rebuilt each run),
# FORCE_WHEELS=1 (install every wheel brought, even where the environment has the package),
# BENCH=0 (skip the benchmark), PYTEST_ARGS (extra pytest arguments, split at spaces), PYTEST_K (one -k
# expression, spaces allowed: "sync or fake"), STEP_TIMEOUT=S (stop the suite and
# each benchmark after S seconds: a lease-limited machine still returns the rest; the e2e benchmark keeps the
# cases it finished), ARCHIVE=1 (leave only run.log and gpu-results.tgz, holding everything, in OUTPUT_DIR:
# for tools that bring few files back).
# Writes into OUTPUT_DIR: run.log, environment.txt, cuda-suite.log/.xml, hybrid_cuda.{json,md,png},
# bench_hybrid.log, zero3_gpu.{json,md,png} (+ trace, timeline), bench_zero3.log, e2e_cuda.{json,md,png}, bench.log.
# Exit status: 0 when the suite and the benchmark both succeeded.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
INSTALL_ONLY=0
if [[ "${1:-}" == "--install-only" ]]; then
    INSTALL_ONLY=1
    shift
fi
OUT_DIR="${1:-${OUT:-$ROOT/gpu-results}}"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
DEPS="${DEPS:-$ROOT/.gpu-deps}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
# DEPS is rebuilt by every run (what is installed there depends on this run's environment and wheels);
# a folder that is not empty and was not made by this script is left alone.
if [[ -d "$DEPS" && -n "$(ls -A "$DEPS")" && ! -e "$DEPS/.made-by-run_on_gpu" ]]; then
    echo "[run_on_gpu] error: DEPS=$DEPS is not empty and was not made by this script; name another folder" >&2
    exit 1
fi
rm -rf "$DEPS"
mkdir -p "$DEPS"
touch "$DEPS/.made-by-run_on_gpu"
DEPS="$(cd "$DEPS" && pwd)"
ENV_PYTHONPATH="${PYTHONPATH:-}"  # the environment as it is, without DEPS: what it lacks is installed
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$DEPS/bin:$PATH"  # ninja (torch's extension builds run it), ds-launch
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[run_on_gpu] $*" | tee -a "$OUT_DIR/run.log"; }
die() { log "error: $*"; exit 1; }

# ---- 1. what the environment lacks, from the wheels brought --------------------------------------------
"$PYTHON" -c "import torch, lightning, pytest" 2>/dev/null \
    || die "$PYTHON needs torch, lightning and pytest installed (a CUDA build of torch)"
missing=()
shopt -s nullglob
for whl in "$WHEELS"/*.whl; do
    dist="$(basename "$whl" | cut -d- -f1)"
    if [[ "${FORCE_WHEELS:-0}" != "1" ]] && PYTHONPATH="$ENV_PYTHONPATH" "$PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
        continue
    fi
    missing+=("$whl")
done
# ds_strategy itself goes in with them, in one pip call: a second ``--target --upgrade`` call would replace
# the bin/ folder of the first (ninja's binary, which torch's extension builds run). The build of the
# package needs setuptools (brought as a wheel where the machine lacks it); --upgrade replaces an earlier copy.
build_tools=""
if ! "$PYTHON" -c "import setuptools" 2>/dev/null; then
    tools=("$WHEELS"/setuptools-*.whl)
    ((${#tools[@]})) || die "setuptools is missing: bring its wheel in $WHEELS (tests/cuda/fetch_wheels.sh does)"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --upgrade --target "$DEPS/.build-tools" "${tools[@]}" \
        || die "pip install of ${tools[*]} failed"
    build_tools="$DEPS/.build-tools:"
fi
names=""
for whl in ${missing[@]+"${missing[@]}"}; do names+=" ${whl##*/}"; done
log "installing into $DEPS: ds_strategy (no dependencies)$names"
PYTHONPATH="$build_tools$PYTHONPATH" "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation --upgrade --target "$DEPS" \
    ${missing[@]+"${missing[@]}"} "$ROOT" || die "pip install --no-deps into $DEPS failed (is setuptools installed, or its wheel in $WHEELS?)"
command -v ninja >/dev/null || log "warning: no ninja on PATH and no ninja wheel in $WHEELS: the kernels cannot be built"
"$PYTHON" - <<'EOF' || die "the installed package does not import; see above"
import importlib.metadata as m

import ds_strategy
import jsonschema  # noqa: F401  - the config schema
import torchmetrics  # noqa: F401

print(f"[run_on_gpu] ds_strategy {m.version('ds_strategy')} from {ds_strategy.__file__}")
EOF
if ((INSTALL_ONLY)); then
    log "install only: done"
    exit 0
fi

# ---- 3. the machine, then the kernels ----------------------------------------------------------------
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || die "torch sees no CUDA device ($("$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: unavailable"
    "$PYTHON" -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'gpu', torch.cuda.get_device_name(0))"
    "$PYTHON" -c "from torch.utils.cpp_extension import CUDA_HOME; print('CUDA_HOME', CUDA_HOME)"
    echo "nvcc: $(command -v nvcc || echo 'not on PATH: the CUDA kernels cannot be built')"
    "$PYTHON" -m pip list 2>/dev/null
} >"$OUT_DIR/environment.txt"
log "$(head -3 "$OUT_DIR/environment.txt" | tr '\n' ' ')"
"$PYTHON" -m ds_strategy.ops build 2>&1 | tee -a "$OUT_DIR/run.log"
build_rc=${PIPESTATUS[0]}
((build_rc == 0)) || log "kernel build failed (rc $build_rc): the suite will report the kernel tests"

# ---- 4. the CUDA suite, then the benchmark ----------------------------------------------------------
limit=()
[[ "${STEP_TIMEOUT:-0}" != "0" ]] && limit=(timeout "$STEP_TIMEOUT")
log "CUDA suite"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
DS_STRATEGY_REQUIRE_KERNELS=1 ${limit[@]+"${limit[@]}"} "$PYTHON" -m pytest tests/cuda tests/ops/test_fused_adam_cuda.py tests/ops/test_quant_cuda.py -q -rs \
    -p no:cacheprovider --junitxml="$OUT_DIR/cuda-suite.xml" ${PYTEST_ARGS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT_DIR/cuda-suite.log"
suite_rc=${PIPESTATUS[0]}
log "CUDA suite: rc $suite_rc"
bench_rc=0
if [[ "${BENCH:-1}" != "0" ]]; then
    # Generation first: it takes seconds, the e2e benchmark minutes (DeepSpeed JIT-builds its optimizer).
    log "GPU generation benchmark (benchmarks/bench_hybrid.py --device cuda)"
    DS_ACCELERATOR=cuda DS_STRATEGY_BENCH_RESULTS="$OUT_DIR" ${limit[@]+"${limit[@]}"} \
        "$PYTHON" -m benchmarks.bench_hybrid --device cuda 2>&1 | tee "$OUT_DIR/bench_hybrid.log"
    bench_rc=${PIPESTATUS[0]}
    log "GPU generation benchmark: rc $bench_rc"
    log "GPU stage-3 benchmark (benchmarks/bench_zero3_gpu.py: HF Llama through Trainer, issue 41)"
    DS_ACCELERATOR=cuda DS_STRATEGY_BENCH_RESULTS="$OUT_DIR" ${limit[@]+"${limit[@]}"} \
        "$PYTHON" -m benchmarks.bench_zero3_gpu --trace 2>&1 | tee "$OUT_DIR/bench_zero3.log"
    zero3_rc=${PIPESTATUS[0]}
    log "GPU stage-3 benchmark: rc $zero3_rc"
    ((zero3_rc == 0)) || bench_rc=$zero3_rc
    log "GPU benchmark (benchmarks/bench_e2e.py --device cuda)"
    DS_ACCELERATOR=cuda DS_STRATEGY_BENCH_RESULTS="$OUT_DIR" ${limit[@]+"${limit[@]}"} \
        "$PYTHON" -m benchmarks.bench_e2e --device cuda --name e2e_cuda 2>&1 | tee "$OUT_DIR/bench.log"
    e2e_rc=${PIPESTATUS[0]}
    log "GPU benchmark: rc $e2e_rc"
    ((e2e_rc == 0)) || bench_rc=$e2e_rc
fi
if [[ "${SEQ:-0}" == "1" ]]; then  # opt-in: issue 45's longest sequence at sp 1 vs sp 8 (fake group), minutes
    log "GPU sequence-parallel benchmark (benchmarks/bench_sequence_fake.py --device cuda)"
    DS_STRATEGY_BENCH_RESULTS="$OUT_DIR" timeout "${SEQ_TIMEOUT:-300}" \
        "$PYTHON" -m benchmarks.bench_sequence_fake --device cuda --timeout 120 2>&1 | tee "$OUT_DIR/bench_sequence.log"
    log "GPU sequence-parallel benchmark: rc ${PIPESTATUS[0]}"
fi
log "results in $OUT_DIR"
if [[ "${ARCHIVE:-0}" == "1" ]]; then
    archive="$(mktemp -d)/gpu-results.tgz"
    tar czf "$archive" -C "$OUT_DIR" . && find "$OUT_DIR" -mindepth 1 ! -name run.log -delete && mv "$archive" "$OUT_DIR/"
fi
((suite_rc == 0 && bench_rc == 0))
