"""Optimizer step on CPU: ds_strategy's fused kernels beside torch.optim.AdamW (foreach, fused) and
DeepSpeed's DeepSpeedCPUAdam, against the memory-traffic ceiling measured in the same run.

Bare step: 50M fp32 parameters, 1 and 2 threads, as one flat tensor and as ~100 tensors; seconds per step
and effective bandwidth at 28 bytes per parameter (read p, g, m, v; write p, m, v). The ceiling is a
trivial loop with exactly that traffic and no math (``ds_strategy::optim_traffic_ceiling_``: p += g,
m += g, v += g), compiled with the same flags, chunking and threads as the kernel.

Full optimizer phase of a bf16 ZeRO-offload step over a flat 50M partition (fp32 grads carrying a loss
scale): unscale + inf/nan check + clip to max_norm + AdamW step + bf16 copy-out of the parameters.
Ours: the fused norm kernel (norm + found_inf in one read) then one fused step pass. Torch: GradScaler's
``_amp_foreach_non_finite_check_and_unscale_``, ``clip_grad_norm_``, ``AdamW(fused=True).step()`` and
``copy_`` into the bf16 buffer.

    python -m benchmarks.run_all optim          # or: python -m benchmarks.bench_optim [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import machine, markdown_table, results_dir, write_results
from ds_strategy.ops import CPUAdam, fused_adam_step, load_cpu_kernels, multi_tensor_l2norm
from ds_strategy.ops.isa import detect_isa

BYTES_PER_PARAM = 28  # Adam fp32: read p, g, m, v (16) + write p, m, v (12)
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _set_threads(n: int) -> None:
    """torch's pool, and the system libgomp that our library and DeepSpeed's extension link against."""
    torch.set_num_threads(n)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(n)


def _time_interleaved(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 2, before: Callable[[], Any] | None = None
) -> dict[str, dict[str, float]]:
    """Time every fn once per round, round-robin, so load from other jobs on a shared machine hits all of
    them alike; report the median and the best round of each."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: {"median_s": statistics.median(s), "min_s": min(s)} for name, s in samples.items()}


def _layout(numel: int, tensors: int) -> list[int]:
    """``tensors`` sizes summing to ``numel``, unequal (0.5x .. 1.5x the mean) like a model's layers."""
    if tensors == 1:
        return [numel]
    gen = torch.Generator().manual_seed(0)
    weights = 0.5 + torch.rand(tensors, generator=gen, dtype=torch.float64)
    sizes = [int(w) for w in (weights / weights.sum() * numel).floor()]
    sizes[-1] += numel - sum(sizes)
    return sizes


def _params(sizes: list[int]) -> list[torch.nn.Parameter]:
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = torch.randn(n) * 1e-3
        params.append(p)
    return params


def _deepspeed_adam() -> tuple[type | None, str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(16))
        probe.grad = torch.zeros(16)
        DeepSpeedCPUAdam([probe]).step()  # JIT-builds its cpu_adam op on first use (~1 min, cached)
        return DeepSpeedCPUAdam, ""
    except Exception as err:
        return None, f"{type(err).__name__}: {err}".splitlines()[0][:300] + "\n" + traceback.format_exc(limit=2)[-300:]


def bare_step(numel: int, tensors: int, threads: int, reps: int, ds_cls: type | None) -> dict[str, Any]:
    _set_threads(threads)
    params = _params(_layout(numel, tensors))
    grads = [p.grad for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    masters = [p.detach() for p in params]
    fns: dict[str, Callable[[], Any]] = {
        "ceiling (C loop, same traffic)": lambda: torch.ops.ds_strategy.optim_traffic_ceiling_(masters, grads, m, v),
        "ds_strategy CPUAdam": CPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step,
        "torch AdamW foreach": torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True).step,
        "torch AdamW fused": torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True).step,
    }
    if ds_cls is not None:
        fns["DeepSpeedCPUAdam"] = ds_cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True).step
    # All optimizers step the same parameters (each with its own state): timing only, values stay sane.
    rows = _time_interleaved(fns, reps)
    for row in rows.values():
        row["gb_per_s"] = BYTES_PER_PARAM * numel / row["min_s"] / 1e9
    return rows


def full_phase(numel: int, threads: int, reps: int, grad_dtype: torch.dtype) -> dict[str, Any]:
    """unscale + inf/nan check + clip + AdamW step + bf16 copy-out over one flat fp32 partition whose
    gradients arrive in ``grad_dtype`` (bf16: as a bf16 model produces them; fp32: already converted)."""
    _set_threads(threads)
    loss_scale, max_norm = 1024.0, 1.0
    scaled_grad = (torch.randn(numel) * 1e-3 * loss_scale).to(grad_dtype)

    # Ours: one read of the gradients for norm + found_inf, then one fused pass that reads the gradients
    # in their own dtype.
    p = torch.randn(numel) * 0.02
    g = scaled_grad.clone()
    m, v, p16 = torch.zeros(numel), torch.zeros(numel), torch.empty(numel, dtype=torch.bfloat16)
    step = [0]

    def ours() -> None:
        norm, found_inf = multi_tensor_l2norm([g])
        if found_inf.item():
            return
        clip_coef = min(1.0, max_norm / (norm.item() / loss_scale + 1e-6))
        step[0] += 1
        fused_adam_step(p, g, m, v, step=step[0], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        grad_scale=loss_scale, clip_coef=clip_coef, out_16bit=p16)  # fmt: skip

    # Torch: the same phase composed from torch ops. Fused AdamW needs fp32 gradients, so bf16 ones are
    # first copied into an fp32 host buffer (as an engine does for torch optimizers); the gradients are
    # restored before every timed step (outside the timing) because unscale and clip rewrite them.
    param = torch.nn.Parameter(torch.randn(numel) * 0.02)
    param.grad = torch.empty(numel)
    incoming = scaled_grad.clone()
    param16 = torch.empty(numel, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    inv_scale = torch.tensor(1.0 / loss_scale)
    grad = param.grad

    def composed() -> None:
        if grad_dtype != torch.float32:
            grad.copy_(incoming)
        found_inf = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv_scale)
        if found_inf.item():
            return
        torch.nn.utils.clip_grad_norm_([param], max_norm)
        opt.step()
        param16.copy_(param.detach())

    return _time_interleaved(
        {
            "ds_strategy fused (norm pass + 1 fused pass)": ours,
            "torch composed (unscale_, clip_grad_norm_, AdamW fused, copy_)": composed,
        },
        reps,
        before=(lambda: grad.copy_(scaled_grad)) if grad_dtype == torch.float32 else None,
    )


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md: speed-ups of ours (best round) over each peer
    in every bare-step configuration, and over the torch composition in every full-phase configuration."""
    out = []
    for config, results in payload["bare_step"].items():
        ours = results["ds_strategy CPUAdam"]["min_s"]
        ceiling = next(r for n, r in results.items() if n.startswith("ceiling"))["min_s"]
        peers = ", ".join(
            f"{n} {r['min_s'] / ours:.2f}x" for n, r in results.items() if n.startswith(("torch", "Deep"))
        )
        out.append((f"bare step {config}: speed-up vs", f"{peers}; {100 * ceiling / ours:.0f}% of ceiling"))
    for config, results in payload["full_phase"].items():
        ours, theirs = results.values()
        out.append((f"full bf16-offload phase {config}: speed-up vs torch composed (median)",
                    f"{theirs['median_s'] / ours['median_s']:.2f}x"))  # fmt: skip
    return out


def _plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bare, full = payload["bare_step"], payload["full_phase"]
    configs = list(bare)
    names = [n for n in bare[configs[0]] if not n.startswith("ceiling")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5), gridspec_kw={"width_ratios": [2.0, 1.2]})
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(configs))]
        ax1.bar(xs, [bare[c].get(name, {}).get("gb_per_s", 0.0) for c in configs], width, label=name)
    for c, config in enumerate(configs):
        ceiling = next(r for n, r in bare[config].items() if n.startswith("ceiling"))["gb_per_s"]
        ax1.hlines(ceiling, c - 0.45, c + 0.45, colors="black", linestyles="dashed",
                   label="memory-traffic ceiling" if c == 0 else None)  # fmt: skip
    ax1.set_xticks(range(len(configs)), configs)
    ax1.set_ylabel("effective GB/s (28 B/param), higher is better")
    ax1.set_title(f"Bare AdamW step, {payload['numel'] / 1e6:.0f}M fp32 params (best of {payload['reps']})")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=5)
    threads = list(full)
    impls = list(full[threads[0]])
    for i, impl in enumerate(impls):
        xs = [t + (i - 0.5) * 0.4 for t in range(len(threads))]
        ax2.bar(xs, [full[t][impl]["median_s"] for t in threads], 0.4, label=impl.split(" (")[0])
    ax2.set_xticks(range(len(threads)), threads, fontsize=8)
    ax2.set_ylabel("seconds per phase, lower is better")
    ax2.set_title("bf16 offload optimizer phase (median)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / "optim.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2M params, 3 repetitions (smoke run)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    numel, reps = (2_000_000, 3) if args.quick else (50_000_000, args.reps)
    if not load_cpu_kernels():
        raise SystemExit("bench_optim: the CPU kernels did not build; nothing to measure")
    ds_cls, ds_error = _deepspeed_adam()
    payload: dict[str, Any] = {
        "machine": {**machine(), "isa": detect_isa(), "note": "shared 2-core machine; other jobs may run"},
        "numel": numel, "reps": reps, "bytes_per_param": BYTES_PER_PARAM,
        "deepspeed_error": ds_error, "bare_step": {}, "full_phase": {},
    }  # fmt: skip
    for threads in (1, 2):
        for tensors in (1, 100):
            config = f"{threads}T {'flat' if tensors == 1 else f'{tensors} tensors'}"
            payload["bare_step"][config] = bare_step(numel, tensors, threads, reps, ds_cls)
            print(config, {k: round(v["gb_per_s"], 1) for k, v in payload["bare_step"][config].items()}, flush=True)
        for grad_dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            key = f"{threads}T, {label} grads"
            payload["full_phase"][key] = full_phase(numel, threads, reps, grad_dtype)
            print(key, {k: round(v["median_s"], 4) for k, v in payload["full_phase"][key].items()}, flush=True)
    rows = []
    for config, results in payload["bare_step"].items():
        ceiling = next(r for n, r in results.items() if n.startswith("ceiling"))
        for name, r in results.items():
            rows.append([config, name, f"{r['median_s']:.4f}", f"{r['min_s']:.4f}", f"{r['gb_per_s']:.1f}",
                         f"{100 * ceiling['min_s'] / r['min_s']:.0f}%"])  # fmt: skip
    table = markdown_table(
        ["config", "implementation", "s/step (median)", "s/step (best)", "GB/s (best)", "% of ceiling (best)"], rows
    )
    phase_rows = []
    for threads, results in payload["full_phase"].items():
        _ours, theirs = results.values()
        for name, r in results.items():
            speedups = [f"{theirs[k] / r[k]:.2f}x" for k in ("median_s", "min_s")]
            phase_rows.append([threads, name, f"{r['median_s']:.4f}", f"{r['min_s']:.4f}", *speedups])
    table += "\n\nFull bf16 offload optimizer phase (unscale + overflow check + clip + step + bf16 copy-out):\n\n"
    table += markdown_table(
        ["config", "implementation", "s (median)", "s (best)", "speed-up (median)", "speed-up (best)"], phase_rows
    )
    if ds_error:
        table += f"\n\nDeepSpeedCPUAdam unavailable: {ds_error.splitlines()[0]}"
    write_results("optim", payload, table)
    _plot(payload)
    print(table)


if __name__ == "__main__":
    main()
