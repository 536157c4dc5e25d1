"""Human-readable numbers in DeepSpeed's flops-profiler style: ``12.58 M``, ``1.2 GMACs``, ``3.4 ms``."""

from __future__ import annotations

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m"), (1e-6, "u"))
_PRECISION = 2


def number_to_string(num: float, units: str | None = None, precision: int = _PRECISION) -> str:
    """``num`` scaled to the largest prefix not above it (``units`` forces one: T, G, M, K, m, u or "")."""
    if units is None:
        if num == 0:
            magnitude, units = 1.0, ""
        else:
            magnitude, units = next(((m, u) for m, u in _PREFIXES if abs(num) >= m), _PREFIXES[-1])
    else:
        magnitude = dict((u, m) for m, u in _PREFIXES).get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = _PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = _PRECISION) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = _PRECISION) -> str:
    """Parameters count in billions as ``B`` (``1.3 B``), the way model sizes are quoted."""
    forced = units.replace("B", "G") if units else units
    return number_to_string(params, forced, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = _PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"
