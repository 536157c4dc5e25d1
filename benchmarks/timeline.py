"""One training step's timeline from a torch.profiler chrome trace: a row per GPU stream (kernels and copies,
coloured by kind: compute, all-gather, reduce-scatter, copy) and a row for the host's stage-3 annotations
(``ds::gather[...]``, ``ds::reduce_scatter``), as a PNG (docs/zero3.md's picture)."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

KINDS = {"compute": "tab:blue", "all-gather": "tab:orange", "reduce-scatter": "tab:red", "copy": "tab:green"}


def kind_of(name: str) -> str:
    low = name.lower()
    if "allgather" in low or "all_gather" in low:
        return "all-gather"
    if "reducescatter" in low or "reduce_scatter" in low:
        return "reduce-scatter"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return "compute"


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def rows(events: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, str]]]:
    """Row label -> [(start us, duration us, kind)]: one row per GPU stream, one for the host annotations."""
    out: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            out[f"GPU stream {e.get('tid')}"].append((float(e["ts"]), float(e["dur"]), kind_of(name)))
        elif cat == "user_annotation" and name.startswith(("ds::gather", "ds::reduce_scatter", "ds::all_gather")):
            kind = "reduce-scatter" if "reduce" in name else "all-gather"
            out["host: ds:: calls"].append((float(e["ts"]), float(e["dur"]), kind))
    return dict(out)


def draw_timeline(trace: Path, png: Path) -> bool:
    """Draw ``trace`` into ``png``; False when matplotlib is missing or the trace holds nothing to draw."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = rows(load(trace))
    if not lanes:
        return False
    t0 = min(s for spans in lanes.values() for s, _, _ in spans)
    names = sorted(lanes, key=lambda n: (n.startswith("host"), -len(lanes[n])))
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(names) + 1.4))
    for y, lane in enumerate(names):
        for kind, color in KINDS.items():
            spans = [((s - t0) / 1e3, d / 1e3) for s, d, k in lanes[lane] if k == kind]
            if spans:
                ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=color, label=kind)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper right", ncol=4, fontsize=8)
    ax.set_yticks(range(len(names)), [_label(n, lanes[n]) for n in names], fontsize=8)
    ax.set_xlabel("ms since the step's first event")
    ax.set_title("one stage-3 training step: streams and the host's gather / reduce calls")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def _label(lane: str, spans: list[tuple[float, float, str]]) -> str:
    if lane.startswith("host"):
        return lane
    counts: dict[str, int] = defaultdict(int)
    for _, _, k in spans:
        counts[k] += 1
    main = max(counts, key=lambda k: counts[k])
    return f"{lane} ({main})"
