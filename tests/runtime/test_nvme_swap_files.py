"""The swap directory of NVMe offload: owner-only, removed at exit, stale ones of dead processes removed at
the next start, and a missing or too small nvme_path refused before anything is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ds_strategy.runtime.swap.files import ROOT_NAME, NvmePathError, SwapDir, _host

CREATE = textwrap.dedent(
    """
    import os, signal, sys
    from ds_strategy.runtime.swap.files import SwapDir
    d = SwapDir(sys.argv[1], rank=0, key="offload_optimizer", need_bytes=0)
    (d.path / "optimizer.swp").write_bytes(b"x" * 4096)
    print(d.path, flush=True)
    how = sys.argv[2]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "_exit":
        os._exit(0)
    """
)


def _run(tmp_path: Path, how: str) -> Path:
    out = subprocess.run([sys.executable, "-c", CREATE, str(tmp_path), how], capture_output=True, text=True)
    assert out.returncode == (-signal.SIGKILL if how == "kill" else 0), out.stderr
    return Path(out.stdout.strip())


def test_swap_directory_is_owner_only_and_removed_at_exit(tmp_path: Path) -> None:
    d = SwapDir(str(tmp_path), rank=3, key="offload_param", need_bytes=0)
    assert d.path.parent == tmp_path / ROOT_NAME and "rank3" in d.path.name
    assert d.path.stat().st_mode & 0o777 == 0o700
    d.remove()
    assert not d.path.exists()
    left = _run(tmp_path, "exit")  # a normal exit: atexit removes it
    assert not left.exists()


@pytest.mark.parametrize("how", ["kill", "_exit"])
def test_a_crashed_process_leaves_its_files_and_the_next_start_removes_them(tmp_path: Path, how: str) -> None:
    left = _run(tmp_path, how)
    assert (left / "optimizer.swp").exists()  # the process died before its atexit
    mine = SwapDir(str(tmp_path), rank=0, key="offload_optimizer", need_bytes=0)
    assert not left.exists() and left in mine.stale_removed
    assert mine.path.exists()
    mine.remove()


def test_another_live_process_keeps_its_directory(tmp_path: Path) -> None:
    root = tmp_path / ROOT_NAME
    root.mkdir()
    alive = root / f"{_host()}-pid1-rank0-0"
    alive.mkdir()  # pid 1 is always alive
    other_host = root / "elsewhere-pid999999-rank0-0"
    other_host.mkdir()
    SwapDir(str(tmp_path), rank=0, key="offload_optimizer", need_bytes=0).remove()
    assert alive.exists() and other_host.exists()


def test_missing_or_small_nvme_path_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(NvmePathError, match=r"zero_optimization\.offload_param\.nvme_path .*does not exist"):
        SwapDir(str(tmp_path / "nope"), rank=0, key="offload_param", need_bytes=0)
    with pytest.raises(NvmePathError, match=r"offload_optimizer\.nvme_path .* MiB free but rank 1 needs"):
        SwapDir(str(tmp_path), rank=1, key="offload_optimizer", need_bytes=2**62)
    assert not any((tmp_path / ROOT_NAME).iterdir())  # nothing was made


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_nvme_path_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(NvmePathError, match="not writable"):
        SwapDir(str(locked), rank=0, key="offload_param", need_bytes=0)
