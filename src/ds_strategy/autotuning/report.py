"""What a tune shows and leaves behind: a progress bar across trials and a table of every trial on rank 0, a
PNG of throughput against memory with the winner marked, and files in ``results_dir``:

- ``trials.json``: every trial (its knobs, verdict, step time, samples/s, peak and predicted memory, MFU);
- ``ds_config.json``: the winner's config, which ``initialize(config=...)`` and ``ZeroStrategy(config=...)``
  load unchanged;
- ``best.json``: the winner's knobs, activation checkpointing included (a model change, not a config key:
  ``AutotuneResult.apply`` makes it);
- ``autotune.png``: the plot (when matplotlib is installed);

and, in ``exps_dir``, each trial's config as ``<name>.json`` (DeepSpeed's experiment files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ds_strategy.table import print_table

from .trial import TrialResult

MIB = 1 << 20


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def table_rows(ranked: Sequence[TrialResult]) -> list[list[str]]:
    rows = []
    for place, t in enumerate(ranked, 1):
        rows.append(
            [
                str(place) if t.fits else "-",
                t.candidate.name,
                "yes" if t.fits else t.status,
                "-" if t.step_s is None else f"{t.step_s * 1e3:,.1f}",
                "-" if t.samples_per_s is None else f"{t.samples_per_s:,.2f}",
                _mib(t.peak_bytes),
                _mib(t.predicted_bytes),
                "-" if t.mfu is None else f"{t.mfu:.1%}",
            ]
        )
    return rows


COLUMNS = ["#", "configuration", "fits", "step ms", "samples/s", "peak MiB", "predicted MiB", "MFU"]


def print_trials(ranked: Sequence[TrialResult], title: str) -> None:
    print_table(title, COLUMNS, table_rows(ranked))


@contextmanager
def progress(total: int, enabled: bool) -> Iterator[Any]:
    """A progress bar across trials (rich's, when installed and ``enabled``); yields ``advance(label)``."""
    if not enabled:
        yield lambda label: None
        return
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield lambda label: None
        return
    with Progress(
        TextColumn("autotune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}")
    ) as bar:
        task = bar.add_task("", total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=label)

        yield advance


def write_results(
    results_dir: Path,
    exps_dir: Path,
    trials: Sequence[TrialResult],
    configs: dict[str, dict[str, Any]],
    best: TrialResult | None,
    summary: dict[str, Any],
) -> None:
    """The files of the module docstring (rank 0 calls it)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    exps_dir.mkdir(parents=True, exist_ok=True)
    for name, config in configs.items():
        _write_json(exps_dir / f"{name}.json", config)
    _write_json(results_dir / "trials.json", {"summary": summary, "trials": [t.as_dict() for t in trials]})
    if best is not None:
        _write_json(results_dir / "ds_config.json", configs[best.candidate.name])
        _write_json(results_dir / "best.json", best.as_dict())
    plot(results_dir / "autotune.png", trials, best)


def read_trials(results_dir: Path) -> list[dict[str, Any]]:
    """The trials a previous tune wrote (``overwrite: false`` reuses them); [] when there are none."""
    path = results_dir / "trials.json"
    if not path.exists():
        return []
    try:
        return list(json.loads(path.read_text())["trials"])
    except (ValueError, KeyError, TypeError):
        return []


def plot(path: Path, trials: Sequence[TrialResult], best: TrialResult | None) -> bool:
    """Throughput against peak memory, one point per trial that fitted, the winner marked; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = [
        (t.candidate.name, t.peak_bytes / MIB, t.samples_per_s)
        for t in trials
        if t.fits and t.samples_per_s is not None and t.peak_bytes is not None
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([x for _, x, _ in points], [y for _, _, y in points], color="tab:blue")
    for name, x, y in points:
        ax.annotate(name, (x, y), fontsize=6, alpha=0.7)
    if best is not None and best.samples_per_s is not None and best.peak_bytes is not None:
        ax.scatter([best.peak_bytes / MIB], [best.samples_per_s], s=160, facecolors="none", edgecolors="tab:red")
        ax.set_title(f"autotune: {len(trials)} trials, best {best.candidate.name}")
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("samples / s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(tmp, path)
