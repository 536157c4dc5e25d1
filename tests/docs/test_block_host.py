"""tests/docs/block_host.py: a forked child runs a command as the interpreter would run it as a process."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.block_host import BlockHost, HostTimeout

pytestmark = pytest.mark.skipif(not BlockHost.usable, reason="the block host forks (Linux)")


@pytest.fixture(scope="module")
def host() -> Iterator[BlockHost]:
    h = BlockHost()
    yield h
    h.close()


def _env(**extra: str) -> dict[str, str]:
    keep = ("PATH", "PYTHONPATH", "HOME")
    return {**{k: os.environ[k] for k in keep if k in os.environ}, "PYTHONUNBUFFERED": "1", **extra}


SCRIPT = """
import atexit, os, sys, threading, time
print("name", __name__, "argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "path0", sys.path[0])
print("env", os.environ.get("BLOCK_HOST_PROBE"), "gone", os.environ.get("NOT_PASSED"))
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
print("to stderr", file=sys.stderr)
"""


def test_a_script_runs_as_main_with_its_argv_cwd_env_threads_and_atexit(host: BlockHost, tmp_path: Path) -> None:
    (tmp_path / "s.py").write_text(SCRIPT)
    os.environ["NOT_PASSED"] = "x"
    try:
        code, out = host.run([sys.executable, "s.py", "a", "b"], tmp_path, _env(BLOCK_HOST_PROBE="1"), 60)
    finally:
        del os.environ["NOT_PASSED"]
    assert code == 0, out
    assert f"name __main__ argv ['a', 'b'] cwd {tmp_path.name} path0 {tmp_path}" in out, out
    assert "env 1 gone None" in out and "to stderr" in out, out
    assert out.index("thread joined") < out.index("atexit ran"), out  # the interpreter's exit order


def test_exit_codes_tracebacks_modules_and_code(host: BlockHost, tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text("import sys\nprint('before')\nsys.exit(3)\n")
    assert host.run([sys.executable, "fail.py"], tmp_path, _env(), 60) == (3, "before\n")
    (tmp_path / "boom.py").write_text("raise ValueError('boom here')\n")
    code, out = host.run([sys.executable, "boom.py"], tmp_path, _env(), 60)
    assert code == 1 and "ValueError: boom here" in out and "Traceback" in out, out
    code, out = host.run([sys.executable, "-m", "json.tool", "--help"], tmp_path, _env(), 60)
    assert code == 0 and "usage:" in out, out
    code, out = host.run([sys.executable, "-c", "import sys; print(sys.argv)", "x"], tmp_path, _env(), 60)
    assert (code, out) == (0, "['-c', 'x']\n")
    assert BlockHost.command(["python3", "s.py"]) is None  # not this interpreter: a process
    assert BlockHost.command([sys.executable, "-X", "dev", "s.py"]) is None


def test_a_timeout_kills_the_child_and_its_children_and_the_host_goes_on(host: BlockHost, tmp_path: Path) -> None:
    code = "import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    code += "open('grandchild', 'w').write(str(p.pid))\nprint('started', flush=True)\ntime.sleep(60)\n"
    (tmp_path / "hang.py").write_text(code)
    start = time.monotonic()
    with pytest.raises(HostTimeout) as info:
        host.run([sys.executable, "hang.py"], tmp_path, _env(), 3)
    assert "started" in info.value.output and time.monotonic() - start < 30
    grandchild = int((tmp_path / "grandchild").read_text())
    assert _gone(grandchild), f"the block's own child {grandchild} outlived the timeout"
    assert host.run([sys.executable, "-c", "print('next')"], tmp_path, _env(), 60) == (0, "next\n")


def _gone(pid: int) -> bool:
    for _ in range(100):
        try:
            os.kill(pid, 0)
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (ProcessLookupError, FileNotFoundError):
            return True
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # killed, not yet reaped by its new parent
            return True
        time.sleep(0.1)
    return False


RANKS = """
import os, sys
import torch.distributed as dist
import torch
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_SIZE", "TORCHELASTIC_RUN_ID")
print("vars", *(f"{k}={os.environ.get(k)}" for k in keys), "threads", torch.get_num_threads(), flush=True)
dist.init_process_group("gloo")  # env:// from MASTER_ADDR / MASTER_PORT: rank 0 serves the store
t = dist.get_rank() * 10 + 1
x = torch.tensor([float(t)])
dist.all_reduce(x)
print(f"rank {dist.get_rank()} sum {x.item():.0f}", flush=True)
dist.destroy_process_group()
if os.environ["RANK"] == sys.argv[1]:
    sys.exit(5)
"""


def test_ranks_run_side_by_side_with_the_launchers_variables_and_one_failure_ends_the_block(
    host: BlockHost, tmp_path: Path
) -> None:
    from benchmarks.common import free_port

    (tmp_path / "r.py").write_text(RANKS)
    code, out = host.run([sys.executable, "r.py", "none"], tmp_path, _env(), 60, ranks=2, port=free_port())
    assert code == 0, out
    for r in (0, 1):
        assert f"vars RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 LOCAL_SIZE=2" in out, out
        assert "threads 1" in out, out  # OMP_NUM_THREADS=1, as the launcher sets it for 2 ranks
        assert f"rank {r} sum 12" in out, out
    # Rank 1 fails after the collective; rank 0 then waits forever: it is stopped, the block fails with 5.
    (tmp_path / "hang.py").write_text(RANKS.replace("sys.exit(5)", "sys.exit(5)\nimport time\ntime.sleep(600)"))
    start = time.monotonic()
    code, out = host.run([sys.executable, "hang.py", "1"], tmp_path, _env(), 120, ranks=2, port=free_port())
    assert code == 5 and "rank 1 exited with code 5" in out, out
    assert time.monotonic() - start < 60, "the surviving rank was not stopped after the grace"
