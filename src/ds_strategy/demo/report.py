"""Rank 0's report of the demo: the comparison table (rich) and the PNG of loss curves and memory per rank."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from ds_strategy.demo.measure import RunResult, mib

LAST_WINDOW = 10  # "last loss" is the mean of this many final steps: one batch is noisy


def last_loss(result: RunResult) -> float:
    tail = result.losses[-LAST_WINDOW:]
    return sum(tail) / len(tail)


def max_loss_gap(result: RunResult, reference: RunResult) -> float:
    """Largest |loss difference| per step over the steps both runs made (same seed, same data order)."""
    pairs = list(zip(result.losses, reference.losses, strict=False))  # the shorter run's steps
    return max(abs(a - b) for a, b in pairs) if pairs else float("nan")


def mfu(result: RunResult, flops_per_token: float, peak_per_rank: float) -> float:
    """Model flops utilisation of a run: its training flops per second (all ranks) over every rank's peak."""
    return result.tokens_per_s * flops_per_token / (peak_per_rank * len(result.peak_rss))


def comparison_table(
    results: Sequence[RunResult],
    reference: str = "ddp",
    title: str = "",
    flops_per_token: float | None = None,
    peak_per_rank: float | None = None,
) -> Table:
    """One row per run; an MFU column when the flops per token and the per-rank peak are given."""
    ref = next((r for r in results if r.name == reference), None)
    with_mfu = flops_per_token is not None and peak_per_rank is not None
    table = Table(title=title or None)
    table.add_column("strategy")
    table.add_column("steps", justify="right")
    table.add_column("loss first", justify="right")
    table.add_column(f"loss last {LAST_WINDOW}", justify="right")
    if ref is not None:
        table.add_column(f"max |loss - {reference}|", justify="right")
    table.add_column("tokens/s", justify="right")
    if with_mfu:
        table.add_column("MFU", justify="right")
    ranks = " / ".join(f"r{i}" for i in range(max(len(r.peak_rss) for r in results)))
    table.add_column(f"model states MiB {ranks}", justify="right")
    table.add_column(f"peak RSS MiB {ranks}", justify="right")
    for r in results:
        row = [r.name, str(r.steps), f"{r.losses[0]:.3f}", f"{last_loss(r):.3f}"]
        if ref is not None:
            row.append("-" if r is ref else f"{max_loss_gap(r, ref):.1e}")
        states = " / ".join(f"{v:,.2f}" for v in mib(r.state_bytes))
        peak = " / ".join(f"{v:,.0f}" for v in mib(r.peak_rss))
        row.append(f"{r.tokens_per_s:,.0f}")
        if with_mfu:
            assert flops_per_token is not None and peak_per_rank is not None
            row.append(f"{100 * mfu(r, flops_per_token, peak_per_rank):.1f}%")
        row += [states, peak if r.peak_is_per_run else f"{peak} (process peak)"]
        table.add_row(*row)
    return table


def plot(results: Sequence[RunResult], path: Path, title: str = "") -> Path:
    """Loss per step of every run (left) and each rank's peak RSS per run (right), as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_state, ax_rss) = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 2, 2]})
    for r, style in zip(
        results, ["-", "--", ":", "-."] * len(results), strict=False
    ):  # curves that coincide stay visible
        ax_loss.plot(range(1, r.steps + 1), r.losses, style, label=f"{r.name} ({r.steps} steps)", linewidth=1.2)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("training loss (mean over ranks)")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    _per_rank_bars(ax_state, results, [mib(r.state_bytes) for r in results], "%.2f")
    ax_state.set_title("model states per rank (params, grads, optimizer)")
    _per_rank_bars(ax_rss, results, [mib(r.peak_rss) for r in results], "%.0f")
    ax_rss.set_title("peak resident memory per rank")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_rank_bars(ax: Any, results: Sequence[RunResult], values: list[list[float]], fmt: str) -> None:
    """One group of bars per run, one bar per rank."""
    world = max(len(v) for v in values)
    width = 0.8 / world
    for rank in range(world):
        xs = [i + (rank - (world - 1) / 2) * width for i in range(len(results))]
        bars = ax.bar(xs, [v[rank] if rank < len(v) else 0.0 for v in values], width, label=f"rank {rank}")
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks(range(len(results)), [r.name for r in results])
    ax.set_ylabel("MiB")
    ax.legend(fontsize=8)
