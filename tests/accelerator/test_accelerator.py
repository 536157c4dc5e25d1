"""get_accelerator: selection (DS_ACCELERATOR, autodetection), identity, memory statistics, seeding, and the
promise that importing the package never initialises CUDA."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_strategy.accelerator import (
    ACCELERATOR_ENV,
    CpuAccelerator,
    CudaAccelerator,
    MpsAccelerator,
    detect_accelerator,
    get_accelerator,
)
from ds_strategy.accelerator.cpu import process_memory, reset_peak_rss

SRC = str(Path(__file__).resolve().parents[2] / "src")
HAS_CUDA = torch.cuda.device_count() > 0


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": SRC, **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)
    return monkeypatch


def test_env_selects_cpu(no_env: pytest.MonkeyPatch) -> None:
    no_env.setenv(ACCELERATOR_ENV, " CPU ")
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator)
    assert acc.device_type == acc.name == "cpu"
    assert acc.communication_backend_name() == "gloo"
    assert acc.device() == torch.device("cpu")
    assert acc.device_name() == acc.current_device_name() == "cpu"
    assert acc.is_available() and acc.device_count() == 1 and acc.current_device() == 0


@pytest.mark.parametrize("value", ["tpu", "gpu", "cuda0"])
def test_env_rejects_unknown_names(no_env: pytest.MonkeyPatch, value: str) -> None:
    no_env.setenv(ACCELERATOR_ENV, value)
    with pytest.raises(ValueError) as err:
        get_accelerator()
    message = str(err.value)
    assert ACCELERATOR_ENV in message and repr(value) in message
    assert "cuda, cpu, mps" in message


def test_name_argument_wins_over_env(no_env: pytest.MonkeyPatch) -> None:
    no_env.setenv(ACCELERATOR_ENV, "nonsense")
    assert isinstance(get_accelerator("cpu"), CpuAccelerator)
    with pytest.raises(ValueError, match="get_accelerator"):
        get_accelerator("xpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the error for a CUDA request on a machine without CUDA")
def test_env_cuda_without_devices_is_a_clear_error(no_env: pytest.MonkeyPatch) -> None:
    no_env.setenv(ACCELERATOR_ENV, "cuda")
    with pytest.raises(RuntimeError, match=f"{ACCELERATOR_ENV}=cuda.*no cuda device"):
        get_accelerator()


def test_autodetect_matches_torch(no_env: pytest.MonkeyPatch) -> None:
    expected = "cuda" if HAS_CUDA else "mps" if torch.backends.mps.is_available() else "cpu"
    assert detect_accelerator() == expected
    assert get_accelerator().device_type == expected
    assert get_accelerator() is get_accelerator()  # one cached, immutable object per kind


def test_accelerators_are_immutable() -> None:
    acc = get_accelerator("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        acc.foo = 1  # type: ignore[attr-defined]


def test_backend_names_per_kind() -> None:
    assert CudaAccelerator().communication_backend_name() == "nccl"
    assert CpuAccelerator().communication_backend_name() == "gloo"
    assert MpsAccelerator().communication_backend_name() == "gloo"
    assert CudaAccelerator().device_name(1) == "cuda:1"
    assert MpsAccelerator().device_name() == "mps"


def test_cpu_memory_stats_follow_rss() -> None:
    acc = get_accelerator("cpu")
    before = acc.memory_stats()
    assert before.kind == "process" and before.device == "cpu"
    assert before.allocated > 10 * 2**20  # a python process with torch holds tens of MiB
    assert before.peak is not None and before.peak >= before.allocated
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    during = acc.memory_stats()
    assert during.allocated >= before.allocated + 48 * 2**20
    assert during.peak is not None and during.peak >= during.allocated
    del block
    peak = acc.max_memory_allocated()
    # The high-water mark outlives the block (within the kernel's lazily synced per-thread RSS counters).
    assert peak is not None and peak >= during.allocated - 2**20
    assert "RSS" in during.describe() and "MiB" in during.describe()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_cpu_reset_peak_lowers_the_high_water_mark() -> None:
    block = torch.ones(128 * 2**20 // 4)  # 128 MiB raises VmHWM
    del block
    rss, peak = process_memory()
    assert peak is not None and peak >= rss
    if not reset_peak_rss():
        pytest.skip("this kernel refuses writes to /proc/self/clear_refs")
    rss_after, peak_after = process_memory()
    assert peak_after is not None and peak_after < peak
    assert peak_after <= rss_after + 16 * 2**20  # reset to (about) the current RSS


def test_manual_seed_is_reproducible() -> None:
    acc = get_accelerator("cpu")
    acc.manual_seed(1234)
    a = torch.randn(8)
    assert acc.initial_seed() == 1234
    acc.manual_seed(1234)
    torch.testing.assert_close(torch.randn(8), a, rtol=0, atol=0)


def test_cpu_synchronize_and_pin_memory_are_harmless() -> None:
    acc = get_accelerator("cpu")
    acc.synchronize()
    t = torch.ones(4)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    assert acc.on_accelerator(t)
    assert acc.reset_peak_memory_stats() in (True, False)


def test_import_is_light_and_never_initialises_cuda() -> None:
    # `import ds_strategy` must not even import torch; selecting and querying an accelerator, importing
    # the comm package and parsing a config must not create a CUDA context (forked workers rely on it).
    code = (
        "import sys, ds_strategy\n"
        "assert 'torch' not in sys.modules, 'import ds_strategy imported torch'\n"
        "from ds_strategy import get_accelerator, init_distributed\n"
        "import ds_strategy.comm, ds_strategy.accelerator, torch\n"
        "acc = get_accelerator()\n"
        "acc.device_type, acc.communication_backend_name(), acc.is_available(), acc.device_count()\n"
        "acc.device_name(0); acc.manual_seed(0)\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
        "print('ok', acc.device_type)\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_can_use_torch_after_selection() -> None:
    # Fork after selecting the accelerator: the child must not be in torch's "bad fork" state and can
    # run CUDA when there is CUDA (the notebook launcher's situation).
    code = (
        "import os, torch, ds_strategy\n"
        "acc = ds_strategy.get_accelerator(); acc.communication_backend_name(); acc.device_count()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = not torch.cuda._is_in_bad_fork()\n"
        "    if ok and torch.cuda.device_count() > 0:\n"
        "        ok = torch.ones(2, device='cuda').sum().item() == 2\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
        "print('ok')\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_memory_stats() -> None:
    acc = get_accelerator("cuda")
    acc.reset_peak_memory_stats()
    x = torch.empty(2**20, device="cuda")
    stats = acc.memory_stats()
    assert stats.kind == "device" and stats.device.startswith("cuda")
    assert stats.allocated >= x.numel() * 4 and stats.peak is not None and stats.peak >= stats.allocated
    pinned = acc.pin_memory(torch.ones(4))
    assert acc.is_pinned(pinned)
