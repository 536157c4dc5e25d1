#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that tests/cuda/run_on_gpu.sh installs on a GPU
# machine without one (docs/gpu.md). Only what a machine with a CUDA torch, Lightning and pytest may lack:
# ds_strategy's runtime dependencies (jsonschema and its own, pybind11, ninja, torchmetrics) and
# pytest-timeout; run_on_gpu.sh installs only those the machine does not already have.
#
#   tests/cuda/fetch_wheels.sh [DEST]        # DEST: default .whl/ in the repository root
#   PYVER=3.11 tests/cuda/fetch_wheels.sh    # the GPU machine's Python (default 3.12)
#   WITH_DEEPSPEED=1 tests/cuda/fetch_wheels.sh   # also DeepSpeed 0.19.8 (the benchmark's yardstick) and
#                                                 # what it needs beyond the GPU image (pydantic, hjson)
#
# Versions are the ones the project is tested with (pyproject.toml's lower bounds are older).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PYVER="${PYVER:-3.12}"
PYTHON="${PYTHON:-python3}"

WHEELS=(
    "jsonschema==4.26.0"
    "jsonschema-specifications==2025.9.1"
    "referencing==0.37.0"
    "rpds-py==2026.9.1"           # compiled: one wheel per Python version (PYVER)
    "attrs==26.1.0"
    "typing-extensions==4.16.0"
    "torchmetrics==1.9.0"
    "lightning-utilities==0.15.3"
    "pybind11==3.1.0"
    "ninja==1.13.2"               # the build tool torch.utils.cpp_extension runs (a binary wheel)
    "pytest-timeout==2.4.0"       # pyproject.toml's [tool.pytest.ini_options] timeout
    "setuptools==84.2.1"          # pip install --no-build-isolation of ds_strategy itself
)

mkdir -p "$DEST"
# Pure-Python wheels (py3-none-any) match any --platform; the manylinux tags cover rpds-py and ninja.
"$PYTHON" -m pip download --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${WHEELS[@]}"
if [[ "${WITH_DEEPSPEED:-0}" == "1" ]]; then
    # DeepSpeed publishes a source distribution only: build its pure-Python wheel here (no ops: it JIT-builds
    # them on the GPU), then the dependencies the GPU image lacks (seen on the H200 machine, 2026-11-26).
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$DEST" "deepspeed==0.19.8"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: \
        --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" \
        "typing-inspection==0.4.5" "hjson==3.1.0"
fi
echo "wheels for Python $PYVER in $DEST:"
ls -1 "$DEST"
