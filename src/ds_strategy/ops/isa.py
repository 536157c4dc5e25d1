"""Which SIMD instruction set to compile the CPU kernels for, and the compiler flags that select it."""

from __future__ import annotations

import platform
from functools import cache

from ds_strategy import env

ISAS = ("avx512", "avx2", "neon", "scalar")
ISA_ENV = env.SIMD

# Exactly the extensions simd.h uses per ISA; never -march=native, so the cache key says what was built.
_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DDS_SIMD_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DDS_SIMD_AVX2"],
    "neon": ["-DDS_SIMD_NEON"],
    "scalar": ["-DDS_SIMD_SCALAR"],
}
_X86_NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
}


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detect_isa() -> str:
    """The best ISA this CPU runs, or the one forced through ``DS_STRATEGY_SIMD``."""
    forced = (env.get(ISA_ENV) or "").strip().lower()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"{ISA_ENV}={forced!r} is not a known instruction set; valid: {', '.join(ISAS)}")
        return forced
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    flags = _cpu_flags()
    for isa in ("avx512", "avx2"):
        if _X86_NEEDS[isa] <= flags:
            return isa
    return "scalar"


def isa_flags(isa: str) -> list[str]:
    return list(_FLAGS[isa])
