"""ZeRO++ at stage 3 (issue 27): convergence, bytes per step and step time with and without each option.

Two parts, both on the GPT of ds_strategy.demo, fp32, AdamW, in CPU processes (gloo + shared memory):

1. Convergence (4 ranks, simulated node size 2): 200 steps (``--steps``) of stage 3 plain, with qwZ
   (``zero_quantized_weights``), hpZ (``zero_hpz_partition_size=2``), qgZ (``zero_quantized_gradients``) and
   all three, on a learnable token task (arithmetic sequences mod 256), the same data and seed for every
   case. Reported: the loss curves (PNG) and the largest gap to the plain run's loss averaged over windows
   of 20 steps, and the comms logger's bytes per step by op and group size (4: every rank, 2: a node pair
   for all-gathers / all-to-alls inside it, or a cross-node pair for qgZ's second all-to-all).
2. Step time (2 and 4 ranks; hpZ on 4 only): one engine per option in the same processes, stepped
   round-robin (8 rounds after 2 warm-up ones; the median of the slowest rank's step), so load from other
   work hits every option alike; bytes per step from each engine's comms logger. On 4 ranks, a
   simulated slow link between the two simulated nodes: every collective of the benchmark's communicators
   sleeps ``bytes x (share of the group's ranks on the other node) / bandwidth`` when issued (so it models
   a blocking link, no overlap), swept over cross-node bandwidths. That shows where each option pays.
   The 4-rank timing runs also tell qgZ where the simulated nodes are (``simulate_hosts``: hosts of 2
   ranks), so its reduction takes both steps (int4 inside a node, int8 across) as on two real hosts; its
   second step is issued while backward goes on ([Note: when step 2 is issued] in
   comm/quantized_all_to_all.py). (Part 1's qgZ case follows the host names: one node of 4, one int8
   all-to-all; its two-step reduction is the all-three case's.) Each option's loss per timed step is
   recorded (the mean over the ranks).
   DeepSpeed's ZeRO++ runs with the same config where it runs here (its quantizers are CUDA kernels: on
   CPU the attempt is recorded with its error).

    python -m benchmarks.bench_zeropp [--quick] [--steps N] [--skip-convergence | --skip-timing] [--conv-shape e2e]

Writes benchmarks/results/zeropp.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import machine, markdown_table, results_dir, run_each, write_results
from benchmarks.training import LossModel, build_engine

CONV_SHAPE = {"layers": 2, "d": 64, "seq": 32, "micro": 4}
# --conv-shape e2e: the e2e benchmark's GPT (8 layers, d 512: ~25M parameters) on sequences of 64 tokens,
# one per rank: 5 x 200 steps at its full 256 x 4 tokens would take hours on 2 CPU cores.
E2E_CONV_SHAPE = {"layers": 8, "d": 512, "seq": 64, "micro": 1}
TIME_SHAPE = {"layers": 2, "d": 256, "seq": 64, "micro": 2}
QUICK_SHAPE = {"layers": 1, "d": 64, "seq": 32, "micro": 2}
OPTIONS: dict[str, dict[str, Any]] = {
    "stage 3": {},
    "qwZ": {"zero_quantized_weights": True},
    "hpZ": {"zero_hpz_partition_size": 2},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+hpZ+qgZ": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True},
}
BANDWIDTHS = (None, 1e9, 2e8, 5e7)  # cross-node bytes/s (None: no cap)
WINDOW = 20
PAIRED_ROUNDS, WARMUP = 8, 2


def _config(extra: dict[str, Any], micro: int, lr: float) -> dict[str, Any]:
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 1000,
        "stage3_prefetch_bucket_size": 500_000,
        "reduce_bucket_size": 500_000,
        "stage3_max_reuse_distance": 0,  # backward re-gathers what forward freed, as at scale
        **extra,
    }
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "comms_logger": {"enabled": True},
        "steps_per_print": 10**9,
    }


def _model(shape: dict[str, int], seed: int = 0) -> LossModel:
    from ds_strategy.demo.model import GPTConfig

    torch.manual_seed(seed)
    return LossModel(GPTConfig(block_size=shape["seq"], n_layer=shape["layers"], n_embd=shape["d"], n_head=4))


def _batches(shape: dict[str, int], steps: int, rank: int, world: int) -> list[Any]:
    """Arithmetic sequences mod 256 (a random start and a step in 1..4): learnable, so the loss falls."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        rows = shape["micro"] * world
        start = torch.randint(0, 256, (rows, 1), generator=gen)
        step = torch.randint(1, 5, (rows, 1), generator=gen)
        tokens = (start + step * torch.arange(shape["seq"] + 1)) % 256
        mine = tokens[rank::world]
        out.append((mine[:, :-1], mine[:, 1:]))
    return out


def _node_share(group: Any, node: int) -> float:
    """The share of ``group``'s ranks on another simulated node than this rank's."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank() // node
    return sum(1 for r in ranks if r // node != me) / len(ranks)


def install_link_cap(bandwidth: float, node: int) -> Callable[[], None]:
    """Make every collective of the communicators (qgZ's all-to-alls included: they go through
    ``Communicator.all_to_all_single``) sleep for its cross-node bytes at ``bandwidth`` bytes/s; returns
    the undo."""
    from ds_strategy.comm.collectives import Communicator

    issue = Communicator._issue

    @functools.wraps(issue)
    def capped_issue(self: Any, op: str, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        time.sleep(tensor.numel() * tensor.element_size() * _node_share(self.group, node) / bandwidth)
        return issue(self, op, tensor, *args, **kwargs)

    Communicator._issue = capped_issue  # type: ignore[method-assign]

    def undo() -> None:
        Communicator._issue = issue  # type: ignore[method-assign]

    return undo


def simulate_hosts(node: int) -> Callable[[], None]:
    """qgZ's node groups as if every ``node`` consecutive ranks were one host (they follow the host names
    otherwise: one node here); returns the undo."""
    from ds_strategy.runtime.zero import zeropp

    host_node_size = zeropp._host_node_size
    zeropp._host_node_size = lambda coll: node  # type: ignore[assignment]

    def undo() -> None:
        zeropp._host_node_size = host_node_size  # type: ignore[assignment]

    return undo


def _bytes_per_step(engine: Any, steps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in engine.comms_logger.summary():
        key = f"{row.op}@{row.world_size}"
        out[key] = out.get(key, 0.0) + row.total_bytes / steps
    return out


def _converge(rank: int, world: int, item: tuple[str, dict[str, Any]], shape: dict[str, int], steps: int) -> Any:
    _, extra = item
    extra = dict(extra)
    seed = extra.pop("_seed", 0)  # the seed runs: plain stage 3 from another initialisation
    engine = build_engine("ds_strategy", _model(shape, seed), _config(extra, shape["micro"], 1e-3))
    losses = []
    for b in _batches(shape, steps, rank, world):
        loss = engine(b)
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    out = {"losses": losses, "bytes": _bytes_per_step(engine, steps)}
    engine.destroy()
    return out


def _time_paired(rank: int, world: int, bandwidth: float | None, shape: dict[str, int], names: list[str]) -> Any:
    """One engine per option in the same processes, stepped round-robin (``PAIRED_ROUNDS`` rounds after
    ``WARMUP``): load from other work hits every option alike, so the per-option medians compare."""
    undo = install_link_cap(bandwidth, world // 2) if bandwidth else None
    hosts = simulate_hosts(world // 2) if world == 4 else None
    try:
        engines = {
            n: build_engine("ds_strategy", _model(shape), _config(OPTIONS[n], shape["micro"], 1e-4)) for n in names
        }
        batches = _batches(shape, WARMUP + PAIRED_ROUNDS, rank, world)
        times: dict[str, list[float]] = {n: [] for n in names}
        losses: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for i, b in enumerate(batches):
            if i == WARMUP:
                for engine in engines.values():
                    engine.comms_logger.reset()
            for n, engine in engines.items():
                dist.barrier()
                start = time.perf_counter()
                loss = engine(b)
                engine.backward(loss)
                engine.step()
                if i >= WARMUP:
                    times[n].append(time.perf_counter() - start)
                    losses[n].append(loss.detach().float())
        out = {}
        for n, e in engines.items():
            mean = torch.stack(losses[n])
            dist.all_reduce(mean)  # after the timed steps: no collective of its own inside them
            out[n] = {
                "s_per_step": times[n],
                "bytes": _bytes_per_step(e, PAIRED_ROUNDS),
                "losses": (mean / world).tolist(),
            }
        for engine in engines.values():
            engine.destroy()
        return out
    finally:
        for restore in (undo, hosts):
            if restore is not None:
                restore()


def _time_deepspeed(rank: int, world: int, name: str, shape: dict[str, int]) -> Any:
    cfg = _config(OPTIONS[name], shape["micro"], 1e-4)
    cfg.pop("comms_logger")
    engine = build_engine("deepspeed", _model(shape), cfg)
    batches = _batches(shape, WARMUP + PAIRED_ROUNDS, rank, world)
    times = []
    for i, b in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss = engine(b)
        engine.backward(loss)
        engine.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return {"s_per_step": times}


def _window_gap(losses: list[float], base: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(_windows(losses), _windows(base), strict=True))


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[i : i + WINDOW]) / len(losses[i : i + WINDOW]) for i in range(0, len(losses), WINDOW)]


def _band_excess(losses: list[float], band: list[list[float]]) -> float:
    """How far (relative) ``losses``' windowed means leave the range of the unquantized runs' (0: inside)."""
    out = 0.0
    for w, runs in zip(_windows(losses), zip(*(_windows(b) for b in band), strict=True), strict=True):
        lo, hi = min(runs), max(runs)
        out = max(out, (lo - w) / lo if w < lo else (w - hi) / hi if w > hi else 0.0)
    return out


def score_convergence(curves: dict[str, Any]) -> None:
    """Per case: the largest windowed gap to plain stage 3 and, where seed runs exist, how far the curve
    leaves the band the unquantized runs span (the trajectory's own sensitivity to a perturbation)."""
    base = curves["stage 3"]["losses"]
    band = [c["losses"] for n, c in curves.items() if n.startswith("stage 3") and "losses" in c]
    for c in curves.values():
        if "losses" in c:
            c["window_gap"] = _window_gap(c["losses"], base)
            c["final_window_loss"] = sum(c["losses"][-WINDOW:]) / len(c["losses"][-WINDOW:])
            if len(band) > 1:
                c["band_excess"] = _band_excess(c["losses"], band)


def run(
    quick: bool,
    steps: int,
    convergence: bool,
    timing: bool = True,
    conv_shape: dict[str, int] | None = None,
    seeds: int = 0,
    only: set[str] | None = None,
) -> dict[str, Any]:
    conv_shape = QUICK_SHAPE if quick else (conv_shape or CONV_SHAPE)
    time_shape = QUICK_SHAPE if quick else TIME_SHAPE
    steps = 8 if quick else steps
    payload: dict[str, Any] = {"machine": machine(), "quick": quick, "conv_shape": conv_shape}
    payload["load_average_at_start"] = list(os.getloadavg())  # 1, 5, 15 minutes: this machine is shared
    if convergence:
        curves: dict[str, Any] = {}
        options = {**OPTIONS, **{f"stage 3 (init seed {k})": {"_seed": k} for k in range(1, seeds + 1)}}
        cases = [(n, OPTIONS[n]) for n in ("stage 3", "qwZ+hpZ+qgZ")] if quick else list(options.items())
        cases = [c for c in cases if not only or c[0] in only]
        world = 2 if quick else 4  # a smoke run: 2 ranks start faster (hpZ is then a no-op)
        for (name, _), ranks in run_each(_converge, world, cases, conv_shape, steps, fresh=False):
            curves[name] = {"error": str(ranks)} if isinstance(ranks, Exception) else ranks[0]
            print(f"convergence {name}: {str(ranks)[-1500:] if isinstance(ranks, Exception) else 'done'}", flush=True)
        payload["convergence"] = {"steps": steps, "window": WINDOW, "world": world, "cases": curves}
    payload["time_shape"] = time_shape
    has_ds = importlib.util.find_spec("deepspeed") is not None
    timings: list[dict[str, Any]] = []

    def slowest_median(ranks: list[Any], name: str) -> float:
        per_round = [max(r[name]["s_per_step"][i] for r in ranks) for i in range(len(ranks[0][name]["s_per_step"]))]
        return statistics.median(per_round)

    for world in () if not timing else (2,) if quick else (2, 4):
        names = [n for n in OPTIONS if world == 4 or "hpZ" not in n]
        bandwidths = [None, 5e7] if quick else ([None] if world == 2 else list(BANDWIDTHS))
        if quick:
            names = ["stage 3", "qwZ"]
        for bw, ranks in run_each(_time_paired, world, bandwidths, time_shape, names, fresh=False):
            for name in names:
                rec: dict[str, Any] = {"world": world, "option": name, "peer": "ds_strategy", "bandwidth": bw}
                if isinstance(ranks, Exception):
                    rec["error"] = (str(ranks).strip().splitlines() or [repr(ranks)])[-1][:200]
                else:
                    rec["s_per_step"] = slowest_median(ranks, name)
                    rec["bytes"] = ranks[0][name]["bytes"]
                    rec["losses"] = ranks[0][name]["losses"]
                timings.append(rec)
                print(f"{world} ranks {name} bw={bw}: {rec.get('s_per_step', rec.get('error'))}", flush=True)
        if has_ds and world == 2 and not quick:  # each in its own processes: a failure must not take the others
            for name, ranks in run_each(_time_deepspeed, world, ["stage 3", "qwZ", "qgZ"], time_shape, fresh=True):
                rec = {"world": world, "option": name, "peer": "deepspeed", "bandwidth": None}
                if isinstance(ranks, Exception):
                    rec["error"] = (str(ranks).strip().splitlines() or [repr(ranks)])[-1][:200]
                else:
                    rec["s_per_step"] = statistics.median(
                        max(r["s_per_step"][i] for r in ranks) for i in range(len(ranks[0]["s_per_step"]))
                    )
                timings.append(rec)
                print(f"{world} ranks deepspeed {name}: {rec.get('s_per_step', rec.get('error'))}", flush=True)
    payload["timings"] = timings
    return payload


def _fmt_bytes(b: dict[str, float] | None) -> str:
    if not b:
        return ""
    keep = {k: v for k, v in b.items() if k.split("@")[0] in ("all_gather", "reduce_scatter", "all_to_all")}
    return ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(keep.items()))


def table(payload: dict[str, Any]) -> str:
    parts = []
    conv = payload.get("convergence")
    if conv:
        rows = []
        for name, c in conv["cases"].items():
            if "error" in c:
                rows.append((name, "failed", "", c["error"][:80]))
                continue
            band = f"{c['band_excess']:.2%}" if "band_excess" in c else "-"
            rows.append((name, f"{c['final_window_loss']:.4f}", f"{c['window_gap']:.2%}", band, _fmt_bytes(c["bytes"])))
        parts.append(
            f"Convergence: {conv['steps']} steps, {conv.get('world', 4)} ranks (simulated node size 2), loss of the "
            f"last {conv['window']} steps, largest gap to stage 3's windowed loss, largest excursion outside the "
            f"band of the unquantized runs (plain stage 3 from other initialisations), MiB per step by op@group "
            "size\n\n"
            + markdown_table(("option", "final loss", "max window gap", "beyond the seed band", "MiB/step"), rows)
        )
    rows = []
    for t in payload["timings"]:
        bw = "no cap" if t["bandwidth"] is None else f"{t['bandwidth'] / 1e6:.0f} MB/s"
        if "error" in t:
            rows.append((t["world"], t["peer"], t["option"], bw, "failed", "", t["error"][:90]))
        else:
            loss = f"{t['losses'][-1]:.4f}" if t.get("losses") else ""
            rows.append(
                (t["world"], t["peer"], t["option"], bw, f"{t['s_per_step']:.3f}", loss, _fmt_bytes(t.get("bytes")))
            )
    parts.append(
        "Step time (median over interleaved rounds of the slowest rank's step, s), the loss of the last timed "
        "step (mean over the ranks) and MiB per step by op@group size; the cross-node cap is simulated (a "
        "sleep per collective for its cross-node bytes); on 4 ranks qgZ's node groups are the simulated "
        f"nodes{_load_note(payload)}\n\n"
        + markdown_table(("ranks", "peer", "option", "cross-node link", "s/step", "last loss", "MiB/step"), rows)
    )
    return "\n\n".join(parts)


def _load_note(payload: dict[str, Any]) -> str:
    load = payload.get("load_average_at_start")
    return (
        ""
        if not load
        else f"; load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)"
    )


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    conv = payload.get("convergence")
    if conv:
        for name, c in conv["cases"].items():
            if "losses" in c:
                seed_run = name.startswith("stage 3 (init seed")  # the unquantized band: grey, dashed
                style = {"color": "0.6", "ls": "--"} if seed_run else {}
                axes[0].plot(c["losses"], label=name, lw=1, **style)
        axes[0].set_xlabel("step")
        axes[0].set_ylabel("loss (mean over 4 ranks)")
        axes[0].set_title("stage 3 GPT, 4 ranks: loss with each ZeRO++ option")
        axes[0].legend(fontsize=8)
    capped = [t for t in payload["timings"] if t["world"] == 4 and t["peer"] == "ds_strategy" and "error" not in t]
    for name in OPTIONS:
        pts = sorted(((t["bandwidth"] or 1e10), t["s_per_step"]) for t in capped if t["option"] == name)
        if pts:
            axes[1].plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], marker="o", label=name)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("cross-node bandwidth (MB/s; rightmost: no cap)")
    axes[1].set_ylabel("s/step")
    axes[1].set_title("4 ranks, 2 simulated nodes: step time vs link")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / "zeropp.png", dpi=120)
    plt.close(fig)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    conv = payload.get("convergence")
    if conv:
        for name, c in conv["cases"].items():
            if "window_gap" in c and not name.startswith("stage 3"):
                out.append((f"ZeRO++ {name}: loss gap to stage 3 ({conv['steps']} steps)", f"{c['window_gap']:.2%}"))
            if "band_excess" in c and not name.startswith("stage 3"):
                out.append((f"ZeRO++ {name}: beyond the unquantized seed band", f"{c['band_excess']:.2%}"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT and 8 steps")
    parser.add_argument("--steps", type=int, default=200, help="convergence steps")
    parser.add_argument(
        "--skip-convergence",
        action="store_true",
        help="time only; keep the convergence part of an existing zeropp.json",
    )
    parser.add_argument(
        "--skip-timing", action="store_true", help="convergence only; keep the timings of an existing zeropp.json"
    )
    parser.add_argument(
        "--seeds", type=int, default=0, help="also train plain stage 3 from this many other initialisations"
    )
    parser.add_argument(
        "--cases", default="", help="comma-separated convergence cases to (re)run, kept beside the previous ones"
    )
    parser.add_argument(
        "--conv-shape",
        choices=("small", "e2e"),
        default="small",
        help=f"the convergence model: small {CONV_SHAPE} or the e2e GPT {E2E_CONV_SHAPE}",
    )
    args = parser.parse_args(argv)
    previous = results_dir() / "zeropp.json"
    old = json.loads(previous.read_text()) if previous.exists() else {}
    shape = E2E_CONV_SHAPE if args.conv_shape == "e2e" else CONV_SHAPE
    only = {c.strip() for c in args.cases.split(",") if c.strip()}
    payload = run(args.quick, args.steps, not args.skip_convergence, not args.skip_timing, shape, args.seeds, only)
    if only and "convergence" in old and "convergence" in payload:  # the other cases from the previous run
        if old.get("conv_shape") != shape or old["convergence"]["steps"] != args.steps:
            raise SystemExit("--cases: the previous zeropp.json has another model or step count; rerun every case")
        payload["convergence"]["cases"] = {**old["convergence"]["cases"], **payload["convergence"]["cases"]}
    if "convergence" in payload:
        score_convergence(payload["convergence"]["cases"])
    if args.skip_convergence and "convergence" in old:
        payload["convergence"] = old["convergence"]
        payload["conv_shape"] = old.get("conv_shape", payload["conv_shape"])  # the model those curves are of
    if args.skip_timing and "timings" in old:
        payload["timings"], payload["time_shape"] = old["timings"], old.get("time_shape")
        payload["load_average_at_start"] = old.get("load_average_at_start")  # the timings' run
    text = table(payload)
    write_results("zeropp", payload, text)
    plot(payload)
    print(text)


if __name__ == "__main__":
    main()
