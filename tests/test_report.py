"""`python -m ds_strategy.report` names versions, backend, each kernel family and what to do."""

from __future__ import annotations

import subprocess
import sys

import torch

from ds_strategy.report import environment_rows, kernel_rows
from ds_strategy.table import format_plain


def test_environment_rows_name_the_essentials() -> None:
    rows = dict(environment_rows())
    assert rows["torch"].startswith(torch.__version__)
    for item in ("python", "lightning", "C++ compiler", "ninja", "nvcc", "accelerator", "comm backend", "kernel cache"):
        assert item in rows
    assert "io_uring" in rows["async I/O libraries"] or "none found" in rows["async I/O libraries"]


def test_kernel_rows_list_norm_family_with_its_ops() -> None:
    rows, hints = kernel_rows()
    cpu_rows = [r for r in rows if r[0] == "norm" and r[1] == "cpu"]
    assert cpu_rows and "multi_tensor_l2norm" in cpu_rows[0][2]
    if torch.version.cuda is None:
        assert any("CUDA build of torch" in h for h in hints)


def test_cli_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "ds_strategy.report"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "kernel cache" in result.stdout and "multi_tensor_l2norm" in result.stdout


def test_plain_table_aligns_columns() -> None:
    text = format_plain("t", ("a", "long column"), [(1, 2), ("three", 4)])
    lines = text.splitlines()
    assert lines[0] == "t" and lines[2].startswith("a      long column")
