"""Which asynchronous I/O libraries the CPU kernel build links: liburing (io_uring) and libaio (Linux AIO).

The aio engine (csrc/aio/) compiles a backend only when its library was found here, at build time, with
both parts present: the shared library on the compiler's search path (``c++ -print-file-name``) and its
header in the ``include`` folder beside that library's prefix (``/usr/lib/x86_64-linux-gnu/liburing.so``
-> ``/usr/include/liburing.h``). Without either, the engine has its blocking pread/pwrite path only.
Debian/Ubuntu: ``apt-get install liburing-dev libaio-dev``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_SYSTEM_INCLUDES = ("/usr/include", "/usr/local/include")


@dataclass(frozen=True)
class AioLibrary:
    backend: str  # the engine's name for it (ds_strategy.ops.aio.backend())
    header: str
    library: str  # -l<library>
    define: str  # the macro csrc/aio/io_queue_*.cpp are compiled under


LIBRARIES = (
    AioLibrary("io_uring", "liburing.h", "uring", "DS_AIO_HAVE_URING"),
    AioLibrary("libaio", "libaio.h", "aio", "DS_AIO_HAVE_LIBAIO"),
)


@dataclass(frozen=True)
class Found:
    library: AioLibrary
    include_dir: Path
    library_dir: Path


def _library_file(cxx: str, name: str) -> Path | None:
    try:
        out = subprocess.run(
            [cxx, f"-print-file-name=lib{name}.so"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(out)
    return path.resolve() if path.is_absolute() and path.exists() else None  # not found: the bare name back


def _include_dir(library_file: Path, header: str) -> Path | None:
    for parent in library_file.parents:  # <prefix>/lib[64]/[multiarch/]libX.so -> <prefix>/include
        if parent.name in ("lib", "lib64") and (parent.parent / "include" / header).is_file():
            return parent.parent / "include"
    return None


@cache
def find(cxx: str) -> tuple[Found, ...]:
    """The libraries present for compiler ``cxx``, best first (io_uring before libaio)."""
    found = []
    for lib in LIBRARIES:
        library_file = _library_file(cxx, lib.library)
        include_dir = _include_dir(library_file, lib.header) if library_file else None
        if library_file is not None and include_dir is not None:
            found.append(Found(lib, include_dir, library_file.parent))
    return tuple(found)


def build_flags(cxx: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(cflags, ldflags) that compile in and link every library found."""
    cflags: list[str] = []
    ldflags: list[str] = []
    for f in find(cxx):
        cflags.append(f"-D{f.library.define}")
        if str(f.include_dir) not in _SYSTEM_INCLUDES:
            cflags += ["-isystem", str(f.include_dir)]
        ldflags.append(f"-l{f.library.library}")
        if not str(f.library_dir).startswith(("/usr/lib", "/lib")):  # e.g. a conda prefix: found at run time too
            ldflags += [f"-L{f.library_dir}", f"-Wl,-rpath,{f.library_dir}"]
    return tuple(cflags), tuple(ldflags)


def compiled_backends(cflags: tuple[str, ...]) -> list[str]:
    """The engine backends a library built with ``cflags`` has, best first; "blocking" always."""
    return [lib.backend for lib in LIBRARIES if f"-D{lib.define}" in cflags] + ["blocking"]
