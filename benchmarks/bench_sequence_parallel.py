"""Ulysses sequence parallelism on CPU ranks (issue 45, criterion 5): peak memory per rank against the sequence
length at sp 1, 2 and 4, the longest sequence under a fixed memory cap, tiled logits / loss against the Hugging
Face ``.loss`` path, and the step time with its all-to-all share, beside DeepSpeed's
``deepspeed.sequence.layer.DistributedAttention`` on the same model and engine.
Writes benchmarks/results/sequence_parallel.{json,md,png}.

    python -m benchmarks.run_all sequence_parallel   # or: python -m benchmarks.bench_sequence_parallel [--quick]

Model: a Hugging Face ``LlamaForCausalLM`` from a config (hidden 256, 8 heads, 4 key/value heads, 4 layers,
MLP 688, vocabulary 8192, untied head: 7.1M parameters), fp32, AdamW, ZeRO stage 3 (stage 2 at one length),
one sequence per step (micro batch 1), world = sp (dp 1), through ``ds_strategy.initialize`` with
``sequence_parallel_size`` and ``attn_implementation="ds_ulysses"`` (sp 1: plain ``sdpa``); each rank gets its
``shard_batch`` slice. gloo process groups, our shared-memory collectives (the all-to-alls of the attention
run on the SP group's ``Communicator``).

Memory: the ranks run with ``MALLOC_PERTURB_`` (glibc writes every block it hands out, so an allocation is
resident as soon as it is made, as on a device) and a fixed ``MALLOC_MMAP_THRESHOLD_`` (blocks over 128 KiB
are mapped and returned when freed, so the resident set follows what is live). Before each measured step:
``gc.collect()``, ``malloc_trim(0)``, then 5 written to /proc/self/clear_refs (VmHWM := VmRSS); the figure
is VmHWM after one step (forward + backward + optimizer step), the highest over the ranks. "Above base" is
that less the rank's resident set before the model was built (torch, transformers, the process groups).
Lengths double from the smallest; a sp stops at the first length whose peak exceeds the cap (that length is
measured and shown) or at the bound: the longest under the cap is the last one below it (so it is known to
a factor of 2). Then, at the last two lengths run, the same step with the loss tiled:
``sequence_loss(model.model(...).last_hidden_state, shift_labels, head=model.lm_head, chunk_size=c)``.

Step time: other processes (no ``MALLOC_*``), one length, median of the timed steps, the highest over the
ranks; ours ("ds_ulysses") and DeepSpeed's attention alternate step by step in one engine (the model's
attention function switched between steps), so load from outside hits both alike. The all-to-all time is
``perf_counter`` around every exchange of the attention on each rank (ours: ``all_to_all._exchange``, which
forward and backward both call; DeepSpeed's: ``single_all_to_all``): layout copies included, and the wait
for the slowest peer too (an all-to-all is a barrier), so on an oversubscribed machine it also counts skew.
Torch threads per rank: cores / ranks (at least 1: 4 ranks on 2 cores share them). Before the timed steps one
forward (no gradient) through each attention on the same batch: equal losses show the peer wired right.

``--quick`` (the smoke test): a tiny model, lengths 256 and 512, memory at sp 1 and 2, step time at sp 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import machine, markdown_table, results_dir, run_ranks, write_results

SHAPE = {"hidden": 256, "heads": 8, "kv_heads": 4, "layers": 4, "intermediate": 688, "vocab": 8192}
QUICK_SHAPE = {"hidden": 64, "heads": 4, "kv_heads": 2, "layers": 2, "intermediate": 128, "vocab": 2048}
MALLOC_ENV = {"MALLOC_PERTURB_": "165", "MALLOC_MMAP_THRESHOLD_": "131072"}
MiB = 2**20
DS_NAME = "ds_deepspeed_ulysses"  # the attention function wrapping DeepSpeed's DistributedAttention (here only)

FULL: dict[str, Any] = {
    "sps": (1, 2, 4),
    "first": 512,  # the doubling search starts here
    "bound": 16384,  # and stops here
    "cap_mib": 1024,
    "chunk": 1024,  # tiled loss: positions per tile
    "stage2_length": 2048,
    "time_sps": (1, 2, 4),
    "time_length": 4096,
    "time_steps": 4,  # timed steps per attention (after one warm-up each)
}
QUICK: dict[str, Any] = {
    "sps": (1, 2),
    "first": 256,
    "bound": 512,
    "cap_mib": 100_000,
    "chunk": 128,
    "stage2_length": 256,
    "time_sps": (2,),
    "time_length": 256,
    "time_steps": 1,
}


# ------------------------------------------------------------------------------------------------- model
def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


class _LM(nn.Module):
    """The Llama with a switch: ``mode = "hf"`` returns its ``.loss`` (the whole ``[B, S/P, V]`` logits),
    ``"tiled"`` the tiled ``sequence_loss`` of ``model.model``'s hidden states through ``lm_head``."""

    def __init__(self, lm: Any, chunk: int) -> None:
        super().__init__()
        self.lm: Any = lm
        self.mode = "hf"
        self.chunk = chunk

    def forward(self, **batch: Any) -> torch.Tensor:
        if self.mode == "hf":
            return self.lm(**batch).loss
        from ds_strategy.sequence import sequence_loss

        hidden = self.lm.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
        return sequence_loss(hidden, batch["shift_labels"], head=self.lm.lm_head, chunk_size=self.chunk)


def llama_config(shape: dict[str, int], max_len: int) -> Any:
    """A Hugging Face ``LlamaConfig`` of ``shape`` (hidden, heads, kv_heads, layers, intermediate, vocab), untied."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        num_hidden_layers=shape["layers"],
        max_position_embeddings=max(max_len, 2048),
        tie_word_embeddings=False,
    )


def _build(shape: dict[str, int], sp: int, stage: int, chunk: int, max_len: int) -> tuple[Any, _LM]:
    import transformers

    import ds_strategy
    from ds_strategy.sequence import register

    register()
    config = llama_config(shape, max_len)
    torch.manual_seed(0)
    lm: Any = transformers.LlamaForCausalLM._from_config(config, attn_implementation="ds_ulysses" if sp > 1 else "sdpa")
    model = _LM(lm.float().train(), chunk)
    engine, *_ = ds_strategy.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "sequence_parallel_size": sp,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "steps_per_print": 10**9,
        },
    )
    return engine, model


def _batch(length: int, vocab: int, sp: int, seed: int) -> dict[str, Any]:
    """One sequence of ``length`` tokens; this rank's shard of it (sp 1: the whole, with ``shift_labels``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (1, length), generator=g)
    if sp > 1:
        from ds_strategy.sequence import shard_batch

        return shard_batch({"input_ids": ids, "labels": ids.clone()})
    shift = torch.cat([ids[:, 1:], ids.new_full((1, 1), -100)], dim=1)
    return {"input_ids": ids, "labels": ids.clone(), "shift_labels": shift, "position_ids": torch.arange(length)[None]}


def _step(engine: Any, model: _LM, batch: dict[str, Any], mode: str) -> float:
    """One training step (forward, backward, optimizer step) in ``mode``; its seconds on this rank."""
    model.mode = mode
    if mode == "hf" and "num_items_in_batch" not in batch:  # sp 1: HF shifts the labels itself
        batch = {k: v for k, v in batch.items() if k != "shift_labels"}
    dist.barrier()
    start = time.perf_counter()
    loss = engine(**batch)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


def _all_max(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]


# ------------------------------------------------------------------------------------------------ memory
def _measured_step(engine: Any, model: _LM, length: int, vocab: int, sp: int, mode: str) -> dict[str, float]:
    from ds_strategy.runtime.host_memory import trim_heap

    batch = _batch(length, vocab, sp, seed=length)
    gc.collect()
    trim_heap()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS
    seconds = _step(engine, model, batch, mode)
    peak = _status("VmHWM")
    return {"peak": peak, "before": before, "seconds": seconds}


def _memory_rank(rank: int, world: int, shape: dict[str, int], plan: dict[str, Any]) -> dict[str, Any]:
    import transformers  # noqa: F401  (before the baseline: its import is not the model's memory)

    import ds_strategy  # noqa: F401

    sp = world
    gc.collect()
    base = _status("VmRSS")
    engine, model = _build(shape, sp, 3, plan["chunk"], plan["bound"])
    _step(engine, model, _batch(plan["first"] // 2, shape["vocab"], sp, seed=1), "hf")  # Adam state, warm code
    rows: list[dict[str, Any]] = []
    length = plan["first"]
    while length <= plan["bound"]:
        m = _measured_step(engine, model, length, shape["vocab"], sp, "hf")
        peak, before, seconds = _all_max(m["peak"], m["before"], m["seconds"])
        rows.append({"length": length, "mode": "hf", "peak": peak, "before": before, "seconds": seconds})
        if peak > plan["cap_mib"] * MiB:
            break
        length *= 2
    tiled: list[dict[str, Any]] = []
    for row in rows[-2:]:
        m = _measured_step(engine, model, row["length"], shape["vocab"], sp, "tiled")
        peak, before, seconds = _all_max(m["peak"], m["before"], m["seconds"])
        tiled.append({"length": row["length"], "mode": "tiled", "peak": peak, "before": before, "seconds": seconds})
    held = _all_max(float(sum(engine.memory_breakdown().values())))[0]
    engine.destroy()
    del engine, model
    # Stage 2 at one length (fresh model and engine; the partitioned stage-3 model is gone).
    engine, model = _build(shape, sp, 2, plan["chunk"], plan["bound"])
    _step(engine, model, _batch(plan["first"] // 2, shape["vocab"], sp, seed=1), "hf")
    m = _measured_step(engine, model, plan["stage2_length"], shape["vocab"], sp, "hf")
    peak, before, seconds = _all_max(m["peak"], m["before"], m["seconds"])
    stage2 = {"length": plan["stage2_length"], "peak": peak, "before": before, "seconds": seconds}
    stage2["held"] = _all_max(float(sum(engine.memory_breakdown().values())))[0]
    engine.destroy()
    base_max = _all_max(float(base))[0]
    return {"sp": sp, "base": base_max, "rows": rows, "tiled": tiled, "stage3_held": held, "stage2": stage2}


# -------------------------------------------------------------------------------------------- step time
def _register_deepspeed_attention(group: dist.ProcessGroup) -> None:
    """transformers attention ``DS_NAME``: torch sdpa (causal, GQA) inside DeepSpeed's DistributedAttention over
    ``group``, in its ``[s, b, h, d]`` layout (``batch_dim_idx=1``)."""
    import transformers
    from deepspeed.sequence.layer import DistributedAttention as DeepSpeedDistributedAttention

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [S, B, h, d] -> [B, h, S, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3)  # [S, B, h, d]

    attention = DeepSpeedDistributedAttention(local, group, scatter_idx=2, gather_idx=0)

    def deepspeed_ulysses(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        q, k, v = (t.permute(2, 0, 1, 3) for t in (query, key, value))  # [B, H, S/P, D] -> [S/P, B, H, D]
        out = attention(q, k, v, 1, None, scaling)  # batch_dim_idx 1, no rotary (HF applied it)
        return out.transpose(0, 1).contiguous(), None  # [B, S/P, H, D]

    transformers.AttentionInterface.register(DS_NAME, deepspeed_ulysses)


class _A2ATimer:
    """Seconds spent in the wrapped all-to-all function since the last ``take()`` (this rank)."""

    def __init__(self, module: Any, name: str) -> None:
        self.seconds = 0.0
        self.calls = 0
        inner = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(module, name, timed)

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def _time_rank(rank: int, world: int, shape: dict[str, int], plan: dict[str, Any]) -> dict[str, Any]:
    from ds_strategy.sequence import all_to_all

    sp = world
    length = plan["time_length"]
    engine, model = _build(shape, sp, 3, plan["chunk"], length)
    impls = {"ds_strategy": model.lm.config._attn_implementation}
    timers = {"ds_strategy": _A2ATimer(all_to_all, "_exchange")}
    errors: dict[str, str] = {}
    if sp > 1 and importlib.util.find_spec("deepspeed") is not None:
        try:
            import deepspeed
            import deepspeed.sequence.layer as ds_layer

            deepspeed.init_distributed(dist_backend="gloo")
            _register_deepspeed_attention(engine.seq_parallel_group)
            impls["deepspeed"] = DS_NAME
            timers["deepspeed"] = _A2ATimer(ds_layer, "single_all_to_all")
        except Exception as err:  # recorded in the results instead of a number
            errors["deepspeed"] = f"{type(err).__name__}: {str(err)[-300:]}"
    # The same forward through each attention, before any step: the peer is wired right if the losses agree.
    losses: dict[str, float] = {}
    check = _batch(length, shape["vocab"], sp, seed=99)
    for name, attn in list(impls.items()):
        model.lm.config._attn_implementation = attn
        try:
            with torch.no_grad():
                losses[name] = float(engine(**check))
        except Exception as err:
            if name == "ds_strategy":
                raise
            errors[name] = f"{type(err).__name__}: {str(err)[-300:]}"
            impls.pop(name)
        timers[name].take()
    times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in impls}
    for i in range(plan["time_steps"] + 1):
        for name, attn in list(impls.items()):
            model.lm.config._attn_implementation = attn
            batch = _batch(length, shape["vocab"], sp, seed=100 + i)
            try:
                seconds = _step(engine, model, batch, "hf")
            except Exception as err:
                if name == "ds_strategy":
                    raise
                errors[name] = f"{type(err).__name__}: {str(err)[-300:]}"
                impls.pop(name)
                continue
            a2a, calls = timers[name].take()
            if i > 0:
                times[name].append((seconds, a2a, calls))
    engine.destroy()
    out: dict[str, Any] = {"sp": sp, "length": length, "errors": errors, "impls": {}, "first_loss": losses}
    for name, rows in times.items():
        if not rows:
            continue
        step = statistics.median(r[0] for r in rows)
        a2a = statistics.median(r[1] for r in rows)
        step_max, a2a_max = _all_max(step, a2a)
        share = _all_max(a2a / step)[0]
        out["impls"][name] = {"step_s": step_max, "a2a_s": a2a_max, "a2a_share": share, "a2a_calls": rows[0][2]}
    return out


# ------------------------------------------------------------------------------------------------ output
def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    longest = payload["longest_under_cap"]
    out.append(
        (
            f"longest sequence under {payload['plan']['cap_mib']} MiB/rank",
            ", ".join(f"sp {sp}: {n if n else '-'}" for sp, n in longest.items()),
        )
    )
    for t in payload["step_time"]:
        ours = t["impls"].get("ds_strategy")
        if ours is None:
            continue
        ds = t["impls"].get("deepspeed")
        peer = f", deepspeed {ds['step_s']:.2f} s ({100 * ds['a2a_share']:.0f}% all-to-all)" if ds else ""
        out.append(
            (
                f"step at {t['length']} tokens, sp {t['sp']}",
                f"{ours['step_s']:.2f} s ({100 * ours['a2a_share']:.0f}% all-to-all){peer}",
            )
        )
    return out


def _mib(x: float) -> str:
    return f"{x / MiB:.0f}"


def table(payload: dict[str, Any]) -> str:
    plan, mem = payload["plan"], payload["memory"]
    m = payload["machine"]
    lines = [
        f"# Ulysses sequence parallelism, CPU ranks ({m.get('cpu_model') or m['cpu']}, {m['cores']} cores, shared "
        f"machine{', --quick' if payload['quick'] else ''})",
        "",
        f"Llama {payload['params'] / 1e6:.1f}M params ({payload['shape']}), fp32, AdamW, micro batch 1, world = sp.",
        "",
        "## Peak RSS per rank of one step vs sequence length (ZeRO-3, HF .loss, MiB; above base in brackets)",
        "",
    ]
    lengths = sorted({r["length"] for s in mem for r in s["rows"]})
    rows = []
    for s in mem:
        by = {r["length"]: r for r in s["rows"]}
        cells = []
        for n in lengths:
            r = by.get(n)
            if r is None:
                cells.append("")
            else:
                over = " (over cap)" if r["peak"] > plan["cap_mib"] * MiB else ""
                cells.append(f"{_mib(r['peak'])} [{_mib(r['peak'] - s['base'])}]{over}")
        rows.append([f"sp {s['sp']}", _mib(s["base"]), *cells])
    lines.append(markdown_table(["sp", "base", *[str(n) for n in lengths]], rows))
    lines += [
        "",
        f"Longest sequence under the cap of {plan['cap_mib']} MiB peak RSS per rank (doubling from {plan['first']}, "
        f"bound {plan['bound']}): "
        + ", ".join(f"sp {sp}: {n if n else 'none'}" for sp, n in payload["longest_under_cap"].items())
        + "; with the tiled loss (run at the last two lengths only, so at least): "
        + ", ".join(f"sp {sp}: {n if n else 'none'}" for sp, n in payload["longest_under_cap_tiled_at_least"].items()),
        "",
        f"## Tiled logits / loss (sequence_loss, chunk {plan['chunk']}) vs HF .loss, ZeRO-3",
        "",
    ]
    rows = []
    cap = plan["cap_mib"] * MiB
    vocab = payload["shape"]["vocab"]
    for s in mem:
        hf = {r["length"]: r for r in s["rows"]}
        for t in s["tiled"]:
            h = hf[t["length"]]
            rows.append(
                [
                    f"sp {s['sp']}",
                    t["length"],
                    f"{t['length'] // s['sp'] * vocab * 4 / MiB:.0f}",
                    _mib(h["peak"]) + (" (over cap)" if h["peak"] > cap else ""),
                    _mib(t["peak"]) + (" (over cap)" if t["peak"] > cap else ""),
                    _mib(h["peak"] - t["peak"]),
                    f"{100 * (h['peak'] - t['peak']) / max(1.0, h['peak'] - s['base']):.0f}%",
                    f"{h['seconds']:.2f}",
                    f"{t['seconds']:.2f}",
                ]
            )
    lines.append(
        markdown_table(
            [
                "sp",
                "length",
                "one [S/P, V] fp32 logits MiB",
                "HF peak",
                "tiled peak",
                "saved",
                "saved / HF above base",
                "HF step s",
                "tiled step s",
            ],
            rows,
        )
    )
    lines += [
        "",
        "Saved / HF above base: the share of the step's memory (peak less the rank's base) that the full "
        "vocabulary projection and its loss take beyond the tiled version.",
    ]
    lines += ["", "## ZeRO stage 2 vs 3 at one length (HF .loss)", ""]
    rows = []
    for s in mem:
        st2 = s["stage2"]
        st3 = next((r for r in s["rows"] if r["length"] == st2["length"]), None)
        rows.append(
            [
                f"sp {s['sp']}",
                st2["length"],
                _mib(st2["peak"]),
                _mib(st3["peak"]) if st3 else "",
                f"{st2['held'] / MiB:.1f}",
                f"{s['stage3_held'] / MiB:.1f}",
            ]
        )
    lines.append(
        markdown_table(["sp", "length", "stage 2 peak", "stage 3 peak", "stage 2 held MiB", "stage 3 held MiB"], rows)
    )
    lines += [
        "",
        f"## Step time at {plan['time_length']} tokens, ZeRO-3 (median of {plan['time_steps']}, max over ranks)",
        "",
    ]
    rows = []
    for t in payload["step_time"]:
        for name, r in t["impls"].items():
            rows.append(
                [
                    f"sp {t['sp']}",
                    name,
                    f"{r['step_s']:.3f}",
                    f"{r['a2a_s']:.3f}",
                    f"{100 * r['a2a_share']:.1f}%",
                    r["a2a_calls"],
                ]
            )
        for name, err in t["errors"].items():
            rows.append([f"sp {t['sp']}", name, f"failed: {err}", "", "", ""])
    lines.append(markdown_table(["sp", "attention", "step s", "all-to-all s", "all-to-all share", "exchanges"], rows))
    checks = [
        f"sp {t['sp']}: " + ", ".join(f"{k} {v:.6f}" for k, v in t["first_loss"].items())
        for t in payload["step_time"]
        if len(t["first_loss"]) > 1
    ]
    if checks:
        lines += [
            "",
            "Loss of one forward before training, rank 0, each attention (the peer wired right): " + "; ".join(checks),
        ]
    lines += ["", payload["notes"]]
    return "\n".join(lines)


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for s in payload["memory"]:
        xs = [r["length"] for r in s["rows"]]
        ax.plot(xs, [r["peak"] / MiB for r in s["rows"]], marker="o", label=f"sp {s['sp']}")
    ax.axhline(payload["plan"]["cap_mib"], color="red", linestyle="--", label="cap")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak RSS per rank, MiB (ZeRO-3)")
    ax.set_title("memory vs sequence length")
    ax.legend()
    ax = axes[1]
    labels, hf, tiled = [], [], []
    for s in payload["memory"]:
        by = {r["length"]: r for r in s["rows"]}
        for t in s["tiled"]:
            labels.append(f"sp {s['sp']}\n{t['length']}")
            hf.append(by[t["length"]]["peak"] / MiB)
            tiled.append(t["peak"] / MiB)
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], hf, width=0.4, label="HF .loss (full logits)")
    ax.bar([x + 0.2 for x in xs], tiled, width=0.4, label=f"tiled (chunk {payload['plan']['chunk']})")
    ax.axhline(payload["plan"]["cap_mib"], color="red", linestyle="--")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("peak RSS per rank, MiB")
    ax.set_title("tiled vs untiled logits / loss")
    ax.legend(fontsize=8)
    ax = axes[2]
    labels, steps, a2a = [], [], []
    for t in payload["step_time"]:
        for name, r in t["impls"].items():
            labels.append(f"sp {t['sp']}\n{name}")
            steps.append(r["step_s"])
            a2a.append(r["a2a_s"])
    xs = list(range(len(labels)))
    ax.bar(xs, steps, label="step")
    ax.bar(xs, a2a, label="of which all-to-all")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(f"seconds per step at {payload['plan']['time_length']} tokens")
    ax.set_title("step time and all-to-all share")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / "sequence_parallel.png", dpi=100)
    plt.close(fig)


def _params(shape: dict[str, int]) -> int:
    h, i, v, n = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    kv = h // shape["heads"] * shape["kv_heads"]
    return 2 * v * h + h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


def run(quick: bool) -> dict[str, Any]:
    shape = QUICK_SHAPE if quick else SHAPE
    plan = dict(QUICK if quick else FULL)
    memory = []
    for sp in plan["sps"]:
        start = time.monotonic()
        with mock.patch.dict(os.environ, MALLOC_ENV):  # the spawned ranks inherit it; restored afterwards
            result = run_ranks(_memory_rank, sp, shape, plan)[0]
        print(f"memory sp {sp}: {time.monotonic() - start:.0f} s", flush=True)
        memory.append(result)
    step_time = []
    for sp in plan["time_sps"]:
        start = time.monotonic()
        step_time.append(run_ranks(_time_rank, sp, shape, plan)[0])
        print(f"step time sp {sp}: {time.monotonic() - start:.0f} s", flush=True)
    longest: dict[str, int | None] = {}
    longest_tiled: dict[str, int | None] = {}  # a lower bound: tiled was run at the last two lengths only
    for s in memory:
        fits = [r["length"] for r in s["rows"] if r["peak"] <= plan["cap_mib"] * MiB]
        longest[str(s["sp"])] = max(fits) if fits else None
        fits_tiled = [r["length"] for r in s["tiled"] if r["peak"] <= plan["cap_mib"] * MiB]
        longest_tiled[str(s["sp"])] = max([*fits, *fits_tiled]) if fits or fits_tiled else None
    deepspeed = None
    if importlib.util.find_spec("deepspeed") is not None:
        from importlib.metadata import version

        deepspeed = version("deepspeed")
    notes = (
        "Shared machine: 2 cores, another engineer's work may run beside it (asked to keep quiet). sp 4 runs 4 "
        "ranks on 2 cores (1 torch thread each, oversubscribed); sp 2 one thread per rank; sp 1 two threads. "
        "All-to-all time: perf_counter around each exchange in the benchmark process (ours: "
        "ds_strategy.sequence.all_to_all._exchange, shared memory; DeepSpeed: deepspeed.sequence.layer."
        "single_all_to_all over the gloo SP group), layout copies and waiting for peers included."
    )
    return {
        "machine": machine(),
        "shared_machine": True,
        "quick": quick,
        "deepspeed": deepspeed,
        "shape": shape,
        "params": _params(shape),
        "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()},
        "malloc_env_memory": MALLOC_ENV,
        "memory": memory,
        "longest_under_cap": longest,
        "longest_under_cap_tiled_at_least": longest_tiled,
        "step_time": step_time,
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and short sequences, sp 1 and 2 (smoke)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    payload = run(args.quick)
    payload["wall_s"] = time.monotonic() - start
    text = table(payload)
    write_results("sequence_parallel", payload, text)
    plot(payload)
    print(text)
    print(json.dumps(headlines(payload), indent=1))


if __name__ == "__main__":
    main()
