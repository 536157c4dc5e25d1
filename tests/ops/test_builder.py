"""The build pipeline: cache keys, one builder per node, stale locks, fallbacks, import stays lazy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_strategy.ops import KernelBuildTimeout, builder
from ds_strategy.ops.builder import LibrarySpec, build_library
from ds_strategy.ops.isa import detect_isa
from tests.harness import run_distributed

TINY_SOURCE = 'extern "C" int ds_tiny_answer() { return 42; }\n'


def _tiny_spec(root: Path, isa: str = "scalar", write: bool = True) -> LibrarySpec:
    src = root / "src"
    if write:
        src.mkdir(parents=True, exist_ok=True)
        (src / "tiny.cpp").write_text(TINY_SOURCE)
    return LibrarySpec(name="ds_tiny", sources=(src / "tiny.cpp",), root=src, isa=isa, cflags=("-O0",))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_cache_key_names_torch_isa_and_source_hash(tmp_path: Path) -> None:
    spec = _tiny_spec(tmp_path)
    key = spec.key()
    assert key.startswith("torch") and "-scalar-" in key
    avx2 = _tiny_spec(tmp_path, isa="avx2")
    assert avx2.key() != key  # a shared cache never serves another ISA's binary
    (tmp_path / "src" / "tiny.cpp").write_text(TINY_SOURCE + "// edited\n")
    assert spec.key() != key  # nor a binary of other sources


def test_real_cpu_spec_key_matches_detected_isa() -> None:
    spec = builder.cpu_spec()
    assert f"-{detect_isa()}-" in spec.key()
    assert any(p.name == "multi_tensor_norm.cpp" for p in spec.sources)
    assert not any(p.name.endswith("_cuda.cpp") for p in spec.sources)


def test_forced_isa_and_bad_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_STRATEGY_SIMD", "scalar")
    assert detect_isa() == "scalar"
    monkeypatch.setenv("DS_STRATEGY_SIMD", "sse9")
    with pytest.raises(ValueError, match=r"DS_STRATEGY_SIMD='sse9'.*valid: avx512, avx2, neon, scalar"):
        detect_isa()


@pytest.mark.serial
def test_build_then_warm_hit(tmp_path: Path) -> None:
    spec = _tiny_spec(tmp_path)
    first = build_library(spec, root=tmp_path / "cache")
    assert first.built_here and first.path.exists()
    info = json.loads((first.path.parent / "build_info.json").read_text())
    assert info["isa"] == "scalar" and info["sources"] == ["tiny.cpp"]
    start = time.monotonic()
    second = build_library(spec, root=tmp_path / "cache")
    assert not second.built_here and second.path == first.path
    assert time.monotonic() - start < 0.5
    assert not list((tmp_path / "cache").glob("*.lock")) and not list((tmp_path / "cache").glob("*.tmp-*"))


def test_stale_lock_of_a_dead_build_is_reported_and_replaced(tmp_path: Path) -> None:
    spec = _tiny_spec(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{spec.key()}.lock"
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename, "started": "earlier"}))
    with pytest.warns(RuntimeWarning, match=f"stale kernel build lock {lock}"):
        built = build_library(spec, root=cache)
    assert built.built_here and not lock.exists()


def test_live_lock_holder_times_out_naming_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _tiny_spec(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{spec.key()}.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started": "now"}))
    monkeypatch.setenv("DS_STRATEGY_BUILD_TIMEOUT", "1")
    with pytest.raises(KernelBuildTimeout, match=f"(?s){lock}.*held by pid {os.getpid()}.*delete"):
        build_library(spec, root=cache)


def _build_tiny_concurrently(rank: int, world_size: int, root: str) -> bool:
    # The source was written before the race: rewriting it here could hand the other rank a truncated
    # file to hash (another cache key) or compile.
    spec = _tiny_spec(Path(root), write=False)
    return build_library(spec, root=Path(root) / "cache").built_here


@pytest.mark.multiprocess
def test_one_process_per_node_compiles(tmp_path: Path) -> None:
    _tiny_spec(tmp_path)  # write the source once, before the ranks race
    built = run_distributed(_build_tiny_concurrently, world_size=2, args=(str(tmp_path),), init_process_group=False)
    assert sorted(built) == [False, True]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_STRATEGY_REQUIRE_KERNELS": "0", **env},
        check=False,
        timeout=120,
    )


def test_import_compiles_nothing(tmp_path: Path) -> None:
    code = "import ds_strategy, ds_strategy.ops; import sys; print('torch.utils.cpp_extension' in sys.modules)"
    result = _run(code, {"TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    assert not (tmp_path / "cache").exists()


def test_without_compiler_one_warning_and_fallback(tmp_path: Path) -> None:
    code = (
        "import torch\n"
        "from ds_strategy.ops import multi_tensor_l2norm\n"
        "for _ in range(3):\n"
        "    norm, inf = multi_tensor_l2norm([torch.full((4,), 2.0)])\n"
        "print(norm.item(), inf.item())\n"
    )
    result = _run(code, {"CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "4.0 0.0"
    assert result.stderr.count("no C++ compiler found") == 1, result.stderr
    assert "pure-torch fallbacks" in result.stderr


def test_cli_build_reports_cached_library(cpu_kernels: bool) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ds_strategy.ops", "build"], capture_output=True, text=True, check=False, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "ds_strategy_cpu" in result.stdout and "cached" in result.stdout


def test_key_does_not_depend_on_where_the_sources_live(tmp_path: Path) -> None:
    # The repository's csrc/ and an installed wheel's ds_strategy/_csrc/ must share one cache entry.
    a = _tiny_spec(tmp_path / "a")
    b = _tiny_spec(tmp_path / "b")
    assert a.key() == b.key()


def test_warm_load_is_fast(cpu_kernels: bool) -> None:
    # Import first (torch's own import takes seconds), then time finding + loading the cached library.
    code = "import time; from ds_strategy.ops import load_cpu_kernels; t = time.perf_counter(); "
    code += "assert load_cpu_kernels(); print(time.perf_counter() - t)"
    result = _run(code, {})
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 1.0
