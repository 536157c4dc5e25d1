"""The autotuner against an exhaustive search of the same space, on 2 CPU ranks (issue 44, criterion 6).

Two models: the GPT of ds_strategy.demo at bench_e2e's shape (8 layers, d=512, seq 256, ~25M parameters) and
a Hugging Face ``LlamaForCausalLM`` built from a config, never downloaded (bench_lora's builder: 4 layers,
hidden 256, intermediate 688, 4 heads, vocab 4096, untied head, ~5.3M parameters; sequences of 128 tokens,
past the config's ``max_position_embeddings`` of 64, which RoPE does not bound). fp32, AdamW, a global
batch of 16 held by every candidate (8 samples per rank). For each model, in the same two processes:

1. the tune: ``ds_strategy.autotune`` with ``tuner_type: "model_based"``, the default early stopping (5),
   fast mode, the default ``SearchSpace()`` (stages 0-3, optimizer offload none / cpu, activation
   checkpointing off / per block) and ``num_tuning_micro_batch_sizes: 2`` (micro batches 4 and 8);
2. the exhaustive search of the same space: ``tuner_type: "gridsearch"`` with early stopping and the trial
   budget out of reach, so every candidate runs;
3. the tune's winner and the exhaustive best run fresh, interleaved (A B, B A, ...: each a new engine,
   ``run_trial``), so load from other work on the shared machine hits both alike: the ratio of those
   fresh measurements beside the ratio of the in-trial ones;
4. a memory cap below the DDP footprint (midway between the smallest peak of any stage-0 trial of the
   exhaustive run and the smallest peak of any other trial): the tune under that cap, and its winner run
   fresh under it (does it stay under?).

Every trial runs ``end_profile_step`` = 3 optimizer steps and times steps 1-2 (median, slowest rank), for the
tune and the exhaustive search alike. Targets: tune winner / exhaustive best >= 0.90 (throughput); the
tune of the e2e GPT under 5 minutes. Writes benchmarks/results/autotune.{json,md,png}. ``--quick``: tiny
models, a global batch of 4 and a smaller space, both models in one set of processes (a smoke run).

    python -m benchmarks.bench_autotune [--quick] [--models gpt,llama] [--no-cap]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.bench_lora import build_base
from benchmarks.common import machine, markdown_table, results_dir, run_each, write_results
from benchmarks.training import QUICK_SHAPE, SHAPE, model_and_batches

WORLD = 2
GLOBAL_BATCH, QUICK_GLOBAL_BATCH = 16, 4
MICRO_SIZES = 2  # num_tuning_micro_batch_sizes
PROFILE_STEPS = (1, 3)  # start_profile_step, end_profile_step: steps 1 and 2 timed, step 0 warms up
FRESH_ROUNDS, QUICK_FRESH_ROUNDS = 3, 1  # fresh runs of each of the two winners, interleaved
FRESH_STEPS = (1, 4)  # the fresh runs time three steps each
SAMPLES = 512  # token rows each model's data holds (read round-robin by micro batch and rank)
LLAMA_SHAPE = {"vocab": 4096, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 4, "seq": 128}
QUICK_LLAMA_SHAPE = {"vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "seq": 32}
RATIO_TARGET, TUNE_BUDGET_S = 0.90, 300.0
MODELS = ("llama", "gpt")  # the quick one first
LABELS = {"gpt": "e2e GPT (ds_strategy.demo)", "llama": "HF LlamaForCausalLM"}


def _gpt(shape: dict[str, int]) -> nn.Module:
    return model_and_batches(shape, 0, 0)[0]  # seed 0: the same weights in every trial and rank


def _llama(shape: dict[str, int]) -> nn.Module:
    torch.manual_seed(0)
    return build_base(shape)


def gpt_loss(model: Callable[..., Any], tokens: torch.Tensor) -> torch.Tensor:
    return model((tokens[:, :-1], tokens[:, 1:]))


def llama_loss(model: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def parts(name: str, quick: bool) -> tuple[Callable[[], nn.Module], torch.Tensor, Any, dict[str, int]]:
    """(model factory, data: a tensor of token rows, loss_fn, shape) of model ``name``."""
    gen = torch.Generator().manual_seed(1)
    if name == "gpt":
        shape = QUICK_SHAPE if quick else SHAPE
        tokens = torch.randint(0, 256, (SAMPLES, shape["seq"] + 1), generator=gen)
        return functools.partial(_gpt, shape), tokens, gpt_loss, shape
    shape = QUICK_LLAMA_SHAPE if quick else LLAMA_SHAPE
    ids = torch.randint(0, shape["vocab"], (SAMPLES, shape["seq"]), generator=gen)
    return functools.partial(_llama, shape), ids, llama_loss, shape


def space(quick: bool) -> Any:
    from ds_strategy.autotuning import SearchSpace

    return SearchSpace(stages=(0, 3), offload_optimizer=("none",)) if quick else SearchSpace()


def config(tmp: str, run: str, quick: bool, **tuning: Any) -> dict[str, Any]:
    """The base config: AdamW, fp32, the global batch held; ``tuning`` over the autotuning block's."""
    return {
        "train_batch_size": QUICK_GLOBAL_BATCH if quick else GLOBAL_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "steps_per_print": 10**9,
        "autotuning": {
            "enabled": True,
            "fast": True,
            "start_profile_step": PROFILE_STEPS[0],
            "end_profile_step": PROFILE_STEPS[1],
            "num_tuning_micro_batch_sizes": MICRO_SIZES,
            "results_dir": os.path.join(tmp, run, "results"),
            "exps_dir": os.path.join(tmp, run, "exps"),
            **tuning,
        },
    }


def _summary(result: Any) -> dict[str, Any]:
    best = result.best
    return {
        "wall_s": result.wall_s,
        "trials_run": result.summary["trials_run"],
        "candidates": result.summary["candidates"],
        "pruned": result.summary["pruned"],
        "memory_cap_bytes": result.summary["memory_cap_bytes"],
        "best": best.candidate.name if best is not None else None,
        "best_samples_per_s": best.samples_per_s if best is not None else None,
        "best_peak_bytes": best.peak_bytes if best is not None else None,
        "trials": [t.as_dict() for t in result.trials],
        "profile": result.summary["profile"],
    }


def _setup(parts_: tuple[Any, ...], base: dict[str, Any], result: Any, steps: tuple[int, int], cap: int | None) -> Any:
    import torch.distributed as dist

    from ds_strategy.autotuning.data import batch_fn_of
    from ds_strategy.autotuning.trial import TrialSetup

    model_fn, data, loss_fn, _ = parts_
    return TrialSetup(
        model_fn=model_fn,
        batch_fn=batch_fn_of(data, dist.get_rank(), dist.get_world_size()),
        loss_fn=loss_fn,
        optimizer=None,
        base_config=base,
        device=torch.device("cpu"),
        world_size=dist.get_world_size(),
        start_step=steps[0],
        end_step=steps[1],
        cap_bytes=cap,
        train_flops_per_sample=result.profile.train_flops_per_sample,
        peak_flops_per_device=None,
    )


def _fresh(setup: Any, winner: Any, best: Any, rounds: int) -> dict[str, Any]:
    """The tune's winner (A) and the exhaustive best (B) run fresh, interleaved A B, B A, ...; per round the
    ratio A / B of samples/s."""
    from ds_strategy.autotuning.trial import run_trial

    if winner == best:
        return {"same_configuration": True, "ratio": 1.0, "rounds": []}
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        measured = {}
        for key, candidate in (("winner", winner), ("best", best))[:: 1 if r % 2 == 0 else -1]:
            trial = run_trial(setup, candidate)
            measured[key] = {"status": trial.status, "samples_per_s": trial.samples_per_s, "peak": trial.peak_bytes}
        runs.append(measured)
    ratios = [
        m["winner"]["samples_per_s"] / m["best"]["samples_per_s"]
        for m in runs
        if m["winner"]["samples_per_s"] and m["best"]["samples_per_s"]
    ]
    return {
        "same_configuration": False,
        "ratio": statistics.median(ratios) if ratios else None,
        "winner_median_samples_per_s": statistics.median(m["winner"]["samples_per_s"] or 0.0 for m in runs),
        "best_median_samples_per_s": statistics.median(m["best"]["samples_per_s"] or 0.0 for m in runs),
        "rounds": runs,
    }


def cap_between(trials: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """(cap, DDP footprint): the smallest measured peak of any fitted stage-0 trial (DDP), and midway between
    it and the smallest peak of any other fitted trial (None, footprint: nothing else is smaller)."""
    fitted = [t for t in trials if t["fits"] and t["peak_bytes"]]
    ddp = min((t["peak_bytes"] for t in fitted if t["stage"] == 0), default=None)
    other = min((t["peak_bytes"] for t in fitted if t["stage"] != 0), default=None)
    if ddp is None or other is None or other >= ddp:
        return None, ddp
    return (ddp + other) // 2, ddp


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def bench_model(rank: int, world: int, name: str, quick: bool, with_cap: bool, tmp: str) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for model ``name``; every rank returns the same figures."""
    from ds_strategy.autotuning import autotune

    model_parts = parts(name, quick)
    model_fn, data, loss_fn, shape = model_parts
    tune = functools.partial(autotune, model_fn, data, loss_fn=loss_fn, space=space(quick), verbose=False)
    tuned_config = config(tmp, f"{name}_tune", quick, tuner_type="model_based")
    tuned = tune(tuned_config)
    _say(rank, f"{name}: tune {tuned.wall_s:.0f} s, {tuned.summary['trials_run']} trials, best {tuned.summary['best']}")
    exhaustive = tune(
        config(tmp, f"{name}_grid", quick, tuner_type="gridsearch", tuner_early_stopping=10**6, tuner_num_trials=10**6)
    )
    _say(rank, f"{name}: exhaustive {exhaustive.wall_s:.0f} s, {exhaustive.summary['trials_run']} trials")
    out: dict[str, Any] = {
        "model": name,
        "label": LABELS[name],
        "shape": shape,
        "params": exhaustive.profile.total_params,
        "tune": _summary(tuned),
        "exhaustive": _summary(exhaustive),
    }
    if tuned.best is None or exhaustive.best is None:
        return out
    out["ratio_in_trial"] = tuned.best.samples_per_s / exhaustive.best.samples_per_s
    again = next(t for t in exhaustive.trials if t.candidate == tuned.best.candidate)  # every candidate ran there
    out["ratio_in_exhaustive"] = (again.samples_per_s or 0.0) / exhaustive.best.samples_per_s
    started = time.perf_counter()
    rounds = QUICK_FRESH_ROUNDS if quick else FRESH_ROUNDS
    setup = _setup(model_parts, tuned_config, tuned, FRESH_STEPS, None)
    out["fresh"] = {**_fresh(setup, tuned.best.candidate, exhaustive.best.candidate, rounds)}
    out["fresh"]["wall_s"] = time.perf_counter() - started
    _say(rank, f"{name}: fresh ratio {out['fresh']['ratio']}")
    if with_cap:
        out["cap"] = _capped(rank, name, quick, tmp, tune, model_parts, out["exhaustive"]["trials"])
    return out


def _capped(
    rank: int, name: str, quick: bool, tmp: str, tune: Callable[..., Any], model_parts: tuple[Any, ...], trials: list
) -> dict[str, Any]:
    """Step 4: the tune under a cap below the DDP footprint, its winner run fresh under the cap."""
    from ds_strategy.autotuning.trial import run_trial

    cap, ddp = cap_between(trials)
    if cap is None:
        return {"ddp_peak_bytes": ddp, "skipped": "no configuration measured below the DDP footprint"}
    capped_config = config(tmp, f"{name}_cap", quick, tuner_type="model_based", max_memory_per_rank=cap)
    capped = tune(capped_config)
    out = {"cap_bytes": cap, "ddp_peak_bytes": ddp, "tune": _summary(capped)}
    if capped.best is not None:
        again = run_trial(_setup(model_parts, capped_config, capped, PROFILE_STEPS, cap), capped.best.candidate)
        out["fresh"] = {"status": again.status, "peak_bytes": again.peak_bytes, "samples_per_s": again.samples_per_s}
        out["fits"] = again.status == "ok" and again.peak_bytes is not None and again.peak_bytes <= cap
    _say(rank, f"{name}: cap {cap / 2**20:.0f} MiB: best {out['tune']['best']}, fresh {out.get('fresh')}")
    return out


def run(models: list[str], quick: bool, with_cap: bool) -> dict[str, Any]:
    """Every model in its own fresh ranks (one set for all of them with ``quick``); the results are written
    after each model, so a run cut short keeps the models it finished."""
    started = time.monotonic()
    payload: dict[str, Any] = {
        "machine": machine(),
        "world_size": WORLD,
        "global_batch": QUICK_GLOBAL_BATCH if quick else GLOBAL_BATCH,
        "num_tuning_micro_batch_sizes": MICRO_SIZES,
        "profile_steps": PROFILE_STEPS,
        "fresh_steps": FRESH_STEPS,
        "quick": quick,
        "targets": {"ratio_min": RATIO_TARGET, "tune_wall_s_max_gpt": TUNE_BUDGET_S},
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "note": "timings on a shared 2-core machine unless said otherwise",
        "models": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, per_rank in run_each(bench_model, WORLD, models, quick, with_cap, tmp, fresh=not quick):
            if isinstance(per_rank, Exception):
                print(f"{name}: failed: {per_rank}", flush=True)
                payload["models"].append({"model": name, "label": LABELS[name], "error": str(per_rank)})
            else:
                payload["models"].append(per_rank[0])
            payload["wall_s"] = time.monotonic() - started
            write_results("autotune", payload, table(payload))
            plot(payload)
    return payload


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _row(m: dict[str, Any]) -> tuple[str, ...]:
    if "error" in m:
        return (m["label"], "failed", *["-"] * 9)
    t, e, fresh = m["tune"], m["exhaustive"], m.get("fresh", {})
    return (
        f"{m['label']} ({m['params'] / 1e6:.1f}M)", t["best"] or "none fitted", _f(t["best_samples_per_s"]),
        f"{t['trials_run']} / {t['wall_s']:.0f} s", e["best"] or "none fitted", _f(e["best_samples_per_s"]),
        f"{e['trials_run']} / {e['wall_s']:.0f} s", _f(m.get("ratio_in_trial"), 3),
        _f(m.get("ratio_in_exhaustive"), 3),
        "1 (same configuration)" if fresh.get("same_configuration") else _f(fresh.get("ratio"), 3),
        _f(t["wall_s"] / e["wall_s"], 2),
    )  # fmt: skip


def _cap_row(label: str, cap: dict[str, Any]) -> tuple[str, ...]:
    if "tune" not in cap:
        return (label, _mib(cap["ddp_peak_bytes"]), "-", cap["skipped"], "-", "-", "-", "-")
    tune, fresh = cap["tune"], cap.get("fresh") or {}
    return (
        label, _mib(cap["ddp_peak_bytes"]), _mib(cap["cap_bytes"]), tune["best"] or "none fitted",
        _mib(tune["best_peak_bytes"]), f"{tune['trials_run']} (+{tune['pruned']} pruned), {tune['wall_s']:.0f} s",
        f"{fresh.get('status', '-')}, {_mib(fresh.get('peak_bytes'))}", "yes" if cap.get("fits") else "no",
    )  # fmt: skip


COLUMNS = (
    "model", "tune: winner", "samples/s", "trials / wall", "exhaustive: best", "samples/s", "trials / wall",
    "ratio (in trial)", "ratio (exhaustive's own)", "ratio (fresh, interleaved)", "tune / exhaustive time",
)  # fmt: skip
CAP_COLUMNS = (
    "model", "DDP peak MiB", "cap MiB", "winner under the cap", "its peak MiB", "trials, wall",
    "fresh run: status, peak MiB", "fresh run under the cap",
)  # fmt: skip


def table(payload: dict[str, Any]) -> str:
    text = markdown_table(COLUMNS, [_row(m) for m in payload["models"]])
    caps = [_cap_row(m["label"], m["cap"]) for m in payload["models"] if m.get("cap")]
    if caps:
        text += "\n\nA memory cap below the DDP footprint (the smallest peak of any stage-0 trial):\n\n"
        text += markdown_table(CAP_COLUMNS, caps)
    start, end = payload["profile_steps"]
    text += (
        f"\n\nTargets: ratio >= {RATIO_TARGET}; the tune of the e2e GPT under {TUNE_BUDGET_S / 60:.0f} minutes. "
        f"Global batch {payload['global_batch']} on {payload['world_size']} CPU ranks; each trial {end} steps, "
        f"from step {start} on timed (median, slowest rank). Ratios, tune winner / exhaustive best in samples/s: "
        "in trial (each as its own run measured it), exhaustive's own (the winner's configuration as the "
        "exhaustive run measured it), fresh (the two rerun interleaved, median of the per-round ratios)."
    )
    if payload["quick"]:
        text += "\n\n--quick: tiny models and a smaller space, both in one set of processes: a smoke run."
    return text


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md."""
    out = []
    for m in payload["models"]:
        if "error" in m:
            out.append((m["label"], "failed"))
            continue
        t, e = m["tune"], m["exhaustive"]
        fresh = m.get("fresh", {}).get("ratio")
        out.append(
            (f"{m['label']}: tune winner / exhaustive best (in trial; fresh)",
             f"{_f(m.get('ratio_in_trial'), 3)}; {_f(fresh, 3)} (target >= {RATIO_TARGET})")
        )  # fmt: skip
        out.append(
            (f"{m['label']}: tune vs exhaustive (trials, wall)",
             f"{t['trials_run']}, {t['wall_s']:.0f} s vs {e['trials_run']}, {e['wall_s']:.0f} s")
        )  # fmt: skip
    return out


def plot(payload: dict[str, Any]) -> None:
    """Per model: samples/s against peak memory of every exhaustive trial, the tune's trials over them, both
    winners marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in payload["models"] if "error" not in m]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6.5 * max(1, len(models)), 5), squeeze=False)
    for ax, m in zip(axes[0], models, strict=False):
        grid = [t for t in m["exhaustive"]["trials"] if t["fits"]]
        tune = [t for t in m["tune"]["trials"] if t["fits"]]
        ax.scatter([_mb(t) for t in grid], [t["samples_per_s"] for t in grid], c="lightgray", edgecolors="gray",
                   s=40, label=f"exhaustive trials ({len(m['exhaustive']['trials'])})")  # fmt: skip
        ax.scatter([_mb(t) for t in tune], [t["samples_per_s"] for t in tune], c="tab:blue", marker="x", s=50,
                   label=f"tune's trials ({m['tune']['trials_run']})")  # fmt: skip
        for who, marker, color in (("tune", "*", "tab:orange"), ("exhaustive", "o", "tab:red")):
            best = next((t for t in m[who]["trials"] if t["name"] == m[who]["best"]), None)
            if best is not None:
                ax.scatter([_mb(best)], [best["samples_per_s"]], marker=marker, s=260, facecolors="none",
                           edgecolors=color, linewidths=2, zorder=3, label=f"{who} winner: {best['name']}")  # fmt: skip
        ax.set_title(
            f"{m['label']}: ratio {_f(m.get('ratio_in_trial'), 3)} (fresh {_f(m.get('fresh', {}).get('ratio'), 3)})"
        )
        ax.set_xlabel("peak memory per rank above the trial's start (MiB)")
        ax.set_ylabel(f"samples/s ({payload['world_size']} CPU ranks), higher is better")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / "autotune.png", dpi=120)
    plt.close(fig)


def _mb(trial: dict[str, Any]) -> float:
    return (trial["peak_bytes"] or 0) / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, a small space, one set of processes")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, among {', '.join(MODELS)}")
    parser.add_argument("--no-cap", action="store_true", help="leave out the memory-cap case")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; known: {', '.join(MODELS)}")
    print(table(run(models, args.quick, not args.no_cap)))


if __name__ == "__main__":
    main()
