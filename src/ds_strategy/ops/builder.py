"""Compile csrc/ on first use into a cache keyed by torch version, ISA and source hash, then load it.

Nothing here runs at import. :func:`load_cpu_kernels` builds (or finds) one shared library holding every
CPU kernel, registers its ops under ``torch.ops.ds_strategy`` and returns True; without a working compiler
it warns once and returns False so callers use the pure-torch fallbacks. CUDA kernels live in a second
library built only when torch has CUDA (:func:`load_cuda_kernels`).

Cache layout (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/ds_strategy``)::

    torch2.13.0-avx2-1a2b3c4d5e6f7a8b/        finished build (renamed into place atomically)
        ds_strategy_cpu.so, build_info.json
    torch2.13.0-avx2-1a2b3c4d5e6f7a8b.lock    held while one process per node compiles
    torch2.13.0-avx2-1a2b3c4d5e6f7a8b.tmp-1234/  that process's build directory
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ds_strategy import env
from ds_strategy.ops import aio_libs
from ds_strategy.ops.isa import detect_isa, isa_flags
from ds_strategy.ops.lock import BuildLock

CPU_LIBRARY = "ds_strategy_cpu"
CUDA_LIBRARY = "ds_strategy_cuda"
TIMEOUT_ENV = env.BUILD_TIMEOUT
REQUIRE_ENV = env.REQUIRE_KERNELS  # "1": a failed build raises instead of falling back
DISABLE_ENV = env.DISABLE_KERNELS  # "1": never build; use the pure-torch fallbacks
_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


class KernelBuildError(RuntimeError):
    """The C++/CUDA sources failed to compile or load."""


def csrc_root() -> Path:
    """The kernel sources: shipped inside the wheel as ``ds_strategy/_csrc``, or the repository's csrc/."""
    packaged = Path(__file__).resolve().parent.parent / "_csrc"
    if packaged.is_dir():
        return packaged
    repo = Path(__file__).resolve().parents[3] / "csrc"
    if repo.is_dir():
        return repo
    raise KernelBuildError(f"kernel sources not found: neither {packaged} nor {repo} exists")


def cache_root() -> Path:
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "ds_strategy"


def compiler() -> str | None:
    """Path of the C++ compiler torch's extension builder will call, or None when there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


@cache
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


@dataclass(frozen=True)
class LibrarySpec:
    """Everything that determines one compiled library; its hash is part of the cache key."""

    name: str
    sources: tuple[Path, ...]
    root: Path
    isa: str
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    with_cuda: bool = False
    extra_hash_inputs: tuple[str, ...] = field(default=())

    def digest(self) -> str:
        h = hashlib.sha256()
        # Every source and header under the root, so an edited header also invalidates the cache.
        for path in sorted(p for p in self.root.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
            h.update(str(path.relative_to(self.root)).encode())
            h.update(path.read_bytes())
        # Relative paths only: the repository's csrc/ and a wheel's _csrc/ must share one cache entry.
        sources = [str(p.relative_to(self.root)) for p in self.sources]
        for part in (self.name, *sources, *self.cflags, *self.ldflags, *self.cuda_cflags):
            h.update(part.encode())
        for part in self.extra_hash_inputs:
            h.update(part.encode())
        return h.hexdigest()[:16]

    def key(self) -> str:
        return f"torch{torch.__version__.split('+')[0]}-{self.isa}-{self.digest()}"


def cpu_spec(isa: str | None = None) -> LibrarySpec:
    root = csrc_root()
    isa = isa or detect_isa()
    sources = tuple(sorted(p for p in root.rglob("*.cpp") if not p.name.endswith("_cuda.cpp")))
    cxx = compiler() or ""
    aio_cflags, aio_ldflags = aio_libs.build_flags(cxx) if cxx else ((), ())  # liburing / libaio when present
    return LibrarySpec(
        name=CPU_LIBRARY,
        sources=sources,
        root=root,
        isa=isa,
        cflags=("-O3", "-fopenmp", "-Wall", *isa_flags(isa), *aio_cflags),
        ldflags=("-fopenmp", *aio_ldflags),
        extra_hash_inputs=(_compiler_version(cxx), torch.__version__),
    )


def cuda_spec() -> LibrarySpec:
    root = csrc_root()
    sources = tuple(sorted([*root.rglob("*.cu"), *root.rglob("*_cuda.cpp")]))
    return LibrarySpec(
        name=CUDA_LIBRARY,
        sources=sources,
        root=root,
        isa=f"cuda{torch.version.cuda}",
        cflags=("-O3",),
        cuda_cflags=("-O3", "-lineinfo"),
        with_cuda=True,
        extra_hash_inputs=(torch.__version__,),
    )


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path
    built_here: bool  # this call compiled it (False: found in the cache or built by a waiting peer)
    seconds: float


def library_path(spec: LibrarySpec, root: Path | None = None) -> Path:
    return (root or cache_root()) / spec.key() / f"{spec.name}.so"


def build_library(spec: LibrarySpec, root: Path | None = None, verbose: bool = False) -> BuiltLibrary:
    """Return the compiled library for ``spec``, compiling it under the node-wide lock if needed."""
    root = root or cache_root()
    key = spec.key()
    final_dir = root / key
    target = final_dir / f"{spec.name}.so"
    if target.exists():
        return BuiltLibrary(target, built_here=False, seconds=0.0)
    timeout = float(env.get(TIMEOUT_ENV) or "900")
    with BuildLock(root / f"{key}.lock", timeout=timeout, done=target.exists) as lock:
        if not lock.acquired or target.exists():
            return BuiltLibrary(target, built_here=False, seconds=0.0)
        start = time.monotonic()
        tmp = root / f"{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _compile(spec, tmp, verbose)
            seconds = time.monotonic() - start
            info = {
                "name": spec.name,
                "isa": spec.isa,
                "torch": torch.__version__,
                "seconds": round(seconds, 2),
                "sources": [str(p.relative_to(spec.root)) for p in spec.sources],
                "pid": os.getpid(),
            }
            (tmp / "build_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
            shutil.rmtree(final_dir, ignore_errors=True)
            os.replace(tmp, final_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return BuiltLibrary(target, built_here=True, seconds=seconds)


def _compile(spec: LibrarySpec, build_dir: Path, verbose: bool) -> None:
    # Imported here: it pulls in setuptools and is only needed when something must be compiled. We call
    # the build-only half of torch.utils.cpp_extension.load (load() would also dlopen the temporary copy);
    # its keyword set differs across torch releases, so pass only the ones this torch accepts.
    from torch.utils import cpp_extension

    if not spec.sources:
        raise KernelBuildError(f"no sources for {spec.name} under {spec.root}")
    build = cpp_extension._write_ninja_file_and_build_library
    accepted = inspect.signature(build).parameters
    kwargs: dict[str, Any] = dict(
        name=spec.name,
        sources=[str(s) for s in spec.sources],
        extra_cflags=list(spec.cflags),
        extra_cuda_cflags=list(spec.cuda_cflags),
        extra_sycl_cflags=[],
        extra_ldflags=list(spec.ldflags),
        extra_include_paths=[str(spec.root)],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=spec.with_cuda,
        with_sycl=False,
        is_standalone=False,
    )
    try:
        build(**{k: v for k, v in kwargs.items() if k in accepted})
    except (RuntimeError, subprocess.CalledProcessError) as err:
        raise KernelBuildError(f"building {spec.name} ({spec.isa}) in {build_dir} failed:\n{err}") from err


def _kernels_disabled() -> bool:
    return env.get(DISABLE_ENV) == "1"


def _fall_back(reason: str) -> bool:
    if env.get(REQUIRE_ENV) == "1":
        raise KernelBuildError(f"{reason} ({REQUIRE_ENV}=1 forbids the pure-torch fallback)")
    warnings.warn(
        f"ds_strategy: {reason}. Using pure-torch fallbacks (slower, same results). "
        "Run `python -m ds_strategy.report` for details.",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


@cache
def load_cpu_kernels() -> bool:
    """Build (once per cache) and load the CPU kernel library; False means use the fallbacks."""
    if _kernels_disabled():
        return False
    if compiler() is None:
        return _fall_back(f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r}; set CXX)")
    try:
        built = build_library(cpu_spec())
        torch.ops.load_library(str(built.path))
    except (KernelBuildError, OSError) as err:
        return _fall_back(f"the CPU kernels could not be built: {err}")
    from ds_strategy.ops.fake_kernels import register_fake_kernels

    register_fake_kernels()
    return True


@cache
def load_cuda_kernels() -> bool:
    """Build and load the CUDA kernel library; False when CUDA or nvcc is missing."""
    if _kernels_disabled() or not load_cpu_kernels() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not torch.cuda.is_available():
        return False
    try:
        built = build_library(cuda_spec())
        torch.ops.load_library(str(built.path))
    except (KernelBuildError, OSError) as err:
        return _fall_back(f"the CUDA kernels could not be built: {err}")
    return True
