"""QLoRA on 2 CPU ranks (issue 46, criterion 1): what each rank holds when training a ``peft`` LoRA on a
bitsandbytes 4-bit (nf4) Llama base, ds_strategy at ZeRO stages 2 and 3, where stage 3 partitions the
4-bit codes and their quantization state ([Note: packed partitions] in runtime/zero/packed_store.py).

The base is a Llama-architecture model built from a config (never downloaded) whose weight is mostly in
its decoder Linears, the layers bitsandbytes quantizes: 16 layers, hidden 1024, MLP 2816, vocabulary 1024,
untied head: 208M parameters, of which 206M in 4 bits (codes 103 MB, absmax 12.8 MB). Made once in the
parent (Hugging Face's initialisation), quantized once (``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16)``, fp32 compute) and saved
pre-quantized, as a QLoRA base is shipped; every rank loads that, then adds rank-8 adapters to q/k/v/o
(``bench_lora``'s, seeded alike everywhere) and trains them with AdamW, fp32, micro batch 2 x 64 tokens
per rank, 3 steps, at stage 2, stage 3 and stage 3 with ``bench_lora``'s bounded live parameters. A
single-process run of the same 4-bit model on the global batch gives the reference losses.

Each rank copies the loaded tensors into memory of their own (``own_memory``: from_pretrained leaves them
in safetensors' memory map of the file, whose touched pages RSS counts for as long as any tensor of the
file lives). Per rank, as bench_lora measures (``MALLOC_PERTURB_`` and a fixed ``MALLOC_MMAP_THRESHOLD_``,
each case in fresh processes): RSS after the run (gc'd, stage 3's gathered-bucket pool trimmed), the peak RSS of the
engine's build and the peak RSS of the training steps (the high-water mark is reset,
``/proc/self/clear_refs``, once the model is loaded and again once the engine is built: the load is the
same in every case, so the peaks compare what the engines add);
the bytes the engine holds (``memory_breakdown``) and, at stage 3, this rank's packed partition. Derived:
stage 2 minus stage 3 beside what partitioning the frozen base over N ranks saves in theory, the frozen
base x (1 - 1/N): the 4-bit codes and absmax, plus the float frozen parameters bitsandbytes leaves
unquantized (embeddings, norms, head), which stage 3 partitions as in LoRA; the fraction of that saving
reached; the 4-bit base / N on its own. Writes benchmarks/results/qlora.{json,md,png}. ``--quick``: a
tiny base (smoke run).

    python -m benchmarks.bench_qlora [--quick]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.bench_lora import (
    LR,
    MALLOC_ENV,
    MICRO,
    QUICK_SHAPE,
    STEPS,
    WORLD,
    _mib,
    _rss_bytes,
    add_lora,
    batches,
    build_base,
    ds_config,
)
from benchmarks.common import machine, markdown_table, peak_rss_bytes, results_dir, run_each, write_results

SHAPE = {"vocab": 1024, "hidden": 1024, "intermediate": 2816, "layers": 16, "heads": 16}
Case = tuple[int, bool]  # (stage, bounded: bench_lora's BOUNDED stage-3 keys instead of the defaults)
CASES: list[Case] = [(2, False), (3, False), (3, True)]


def load_4bit(path: str) -> torch.nn.Module:
    """The pre-quantized base (its saved config carries the quantization), LoRA added, training mode."""
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.float32)
    return add_lora(base).train()  # from_pretrained returns eval mode ([Note: the CPU repack])


@torch.no_grad()
def own_memory(model: torch.nn.Module) -> None:
    """Copy every parameter, buffer and quantization-state tensor into memory of its own: from_pretrained
    leaves them slices of safetensors' memory map of the file, whose pages (clean, reclaimable) count in RSS
    once touched and stay mapped while any tensor of the file lives, whoever has let go of the others. A
    load onto a device copies them likewise."""
    for p in model.parameters():
        p.data = p.data.clone()
        state = getattr(p, "quant_state", None)
        for holder in (state, getattr(state, "state2", None)):
            for name in ("absmax", "code", "offset"):
                value = getattr(holder, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(holder, name, value.clone())
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.clone()


def quantize_base(shape: dict[str, int], tmp: str) -> str:
    """Build the fp32 base, quantize it to nf4 once and save it pre-quantized; returns its directory."""
    import transformers

    torch.manual_seed(0)
    fp32, quantized = str(Path(tmp) / "fp32"), str(Path(tmp) / "nf4")
    build_base(shape).save_pretrained(fp32)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_quant_storage=torch.bfloat16,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = transformers.LlamaForCausalLM.from_pretrained(
        fp32, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    model.save_pretrained(quantized)
    return quantized


def base_bytes(model: torch.nn.Module) -> dict[str, int]:
    """The frozen base's bytes: 4-bit codes, their absmax, and the float frozen parameters."""
    packed = [p for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    codes = sum(p.numel() * p.element_size() for p in packed)
    absmax = sum(p.quant_state.absmax.nbytes for p in packed)
    floats = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if not p.requires_grad and getattr(p, "quant_state", None) is None
    )
    return {"codes": codes, "absmax": absmax, "float_frozen": floats}


def reference_losses(path: str, shape: dict[str, int]) -> list[float]:
    """One process, the same 4-bit model and adapters, the global batch, torch.optim.AdamW."""
    model = load_4bit(path)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for ids in batches(shape):
        loss = torch.stack([model(input_ids=h, labels=h).loss for h in ids.chunk(WORLD)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reset_peak_rss() -> None:
    """Linux: the peak RSS (VmHWM) starts again from the current RSS."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _run_one(rank: int, world: int, case: Case, shape: dict[str, int], path: str) -> dict[str, Any]:
    import torch.distributed as dist

    import ds_strategy
    from ds_strategy.runtime import host_memory

    stage, bounded = case
    model = load_4bit(path)
    own_memory(model)
    sizes = base_bytes(model)
    gc.collect()
    loaded = _rss_bytes()
    _reset_peak_rss()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_strategy.initialize(model=model, model_parameters=trainable, config=ds_config(stage, bounded))
    build_peak = peak_rss_bytes()
    _reset_peak_rss()
    losses = []
    for ids in batches(shape):
        mine = ids[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    gc.collect()
    pool_cached = host_memory.pool_stats()[1]
    host_memory.trim()  # the gathered-bucket pool's cache (see bench_lora)
    packed = getattr(engine.stage, "packed", [])
    return {
        "losses": losses,
        "rss_loaded": loaded,
        "rss_after": _rss_bytes(),
        "build_peak_rss": build_peak,
        "peak_rss": peak_rss_bytes(),
        "pool_cached": pool_cached,
        "engine_bytes": engine.memory_breakdown(),
        "packed_partition_bytes": sum(gs.rest.nbytes() for gs in packed),
        **sizes,
    }


def run(quick: bool) -> dict[str, Any]:
    shape = QUICK_SHAPE if quick else SHAPE
    with mock.patch.dict("os.environ", MALLOC_ENV), tempfile.TemporaryDirectory() as tmp:  # ranks inherit it
        path = quantize_base(shape, tmp)
        ref = reference_losses(path, shape)
        records: list[dict[str, Any]] = []
        for (stage, bounded), per_rank in run_each(_run_one, WORLD, CASES, shape, path, fresh=not quick):
            name = f"stage {stage}" + (" (live <= 1e7)" if bounded else "")
            record: dict[str, Any] = {"case": name, "stage": stage, "bounded": bounded}
            if isinstance(per_rank, Exception):
                print(f"{name}: failed: {per_rank}", flush=True)
                records.append({**record, "error": str(per_rank)})
                continue
            losses = per_rank[0]["losses"]
            record.update(
                ranks=per_rank,
                rss_loaded=max(r["rss_loaded"] for r in per_rank),
                rss_after=max(r["rss_after"] for r in per_rank),
                build_peak_rss=max(r["build_peak_rss"] for r in per_rank),
                peak_rss=max(r["peak_rss"] for r in per_rank),
                pool_cached=max(r["pool_cached"] for r in per_rank),
                packed_partition_bytes=max(r["packed_partition_bytes"] for r in per_rank),
                losses=losses,
                max_loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)),
            )
            records.append(record)
            print(f"{name}: RSS after {_mib(record['rss_after'])} MiB/rank", flush=True)
    return {
        "machine": machine(),
        "quick": quick,
        "shape": shape,
        "world_size": WORLD,
        "malloc_env": MALLOC_ENV,
        "reference_losses": ref,
        "cases": records,
        "derived": derive(records),
    }


def derive(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage 2 minus stage 3 beside the theoretical saving (see the module docstring)."""
    sizes = next(r["ranks"][0] for r in records if "ranks" in r)
    four_bit = sizes["codes"] + sizes["absmax"]
    frozen = four_bit + sizes["float_frozen"]
    out: dict[str, Any] = {
        "four_bit_base_bytes": four_bit,
        "four_bit_base_over_n": four_bit / WORLD,
        "frozen_base_bytes": frozen,
        "theoretical_saving_bytes": frozen * (1 - 1 / WORLD),
    }
    by = {(r["stage"], r["bounded"]): r for r in records if "error" not in r}
    for bounded in (False, True):
        if (2, False) in by and (3, bounded) in by:
            two, three = by[(2, False)], by[(3, bounded)]
            key = "stage2_minus_stage3" + ("_bounded" if bounded else "")
            for kind in ("rss_after", "build_peak_rss", "peak_rss"):
                saved = two[kind] - three[kind]
                out[f"{key}_{kind}"] = saved
                out[f"{key}_{kind}_fraction"] = saved / out["theoretical_saving_bytes"]
    return out


def table(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["cases"]:
        if "error" in r:
            rows.append((r["case"], "failed", "", "", "", "", "", r["error"].strip().splitlines()[-1][:100]))
            continue
        held = r["ranks"][0]["engine_bytes"]
        packed = _mib(r["packed_partition_bytes"]) if r["stage"] == 3 else "whole"
        rows.append(
            (r["case"], _mib(r["rss_after"]), _mib(r["build_peak_rss"]), _mib(r["peak_rss"]),
             f"{_mib(held['params'])} / {_mib(held['master'] + held['optimizer_state'])}", packed,
             f"{r['max_loss_rel_diff']:.1e}", "")
        )  # fmt: skip
    cols = ("case", "RSS after (MiB/rank)", "peak RSS, build (MiB/rank)", "peak RSS, training (MiB/rank)",
            "engine: params / masters+optimizer (MiB)", "4-bit partition (MiB/rank)", "loss vs one process (max rel.)",
            "note")  # fmt: skip
    d = payload["derived"]
    loaded = max(r["rss_loaded"] for r in payload["cases"] if "error" not in r)
    lines = [
        f"QLoRA (nf4, r=8, q/k/v/o) on a Llama base of {_mib(d['frozen_base_bytes'])} MiB frozen "
        f"({_mib(d['four_bit_base_bytes'])} MiB 4-bit codes + absmax), {payload['world_size']} ranks, fp32 compute, "
        f"AdamW, {STEPS} steps; RSS once the model is loaded: {_mib(loaded)} MiB/rank.",
        "",
        markdown_table(cols, rows),
        "",
        f"4-bit base / N: {_mib(d['four_bit_base_over_n'])} MiB; theoretical saving of stage 3 (the frozen base "
        f"x (1 - 1/N)): {_mib(d['theoretical_saving_bytes'])} MiB per rank.",
    ]
    for bounded in ("", "_bounded"):
        key = "stage2_minus_stage3" + bounded
        if key + "_rss_after" in d:
            lines.append(
                f"stage 2 minus stage 3{' (live <= 1e7)' if bounded else ''}: RSS after the run "
                f"{_mib(d[key + '_rss_after'])} MiB ({d[key + '_rss_after_fraction']:.0%} of the theoretical saving), "
                f"peak RSS of the build {_mib(d[key + '_build_peak_rss'])} MiB "
                f"({d[key + '_build_peak_rss_fraction']:.0%}), of the training steps {_mib(d[key + '_peak_rss'])} MiB "
                f"({d[key + '_peak_rss_fraction']:.0%}) per rank."
            )
    return "\n".join(lines)


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in payload["cases"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(ok))
    ax.bar([i - 0.27 for i in x], [r["rss_after"] / 2**20 for r in ok], 0.27, label="RSS after the run")
    ax.bar(list(x), [r["build_peak_rss"] / 2**20 for r in ok], 0.27, label="peak RSS, build")
    ax.bar([i + 0.27 for i in x], [r["peak_rss"] / 2**20 for r in ok], 0.27, label="peak RSS, training")
    two = next((r for r in ok if r["stage"] == 2), None)
    if two is not None:  # where stage 3 would be with the whole theoretical saving
        ideal = (two["rss_after"] - payload["derived"]["theoretical_saving_bytes"]) / 2**20
        ax.axhline(ideal, color="gray", ls="--", lw=1, label="stage 2's RSS after - theoretical saving")
    ax.set_xticks(list(x), [r["case"] for r in ok])
    ax.set_ylabel("MiB per rank")
    ax.set_title("QLoRA (nf4 base), 2 ranks")
    ax.set_ylim(0, 1.3 * max(r["peak_rss"] for r in ok) / 2**20)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(results_dir() / "qlora.png", dpi=120)
    plt.close(fig)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md."""
    d = payload["derived"]
    out = [("4-bit base / N", f"{_mib(d['four_bit_base_over_n'])} MiB")]
    for bounded in ("", "_bounded"):
        key = "stage2_minus_stage3" + bounded
        if key + "_rss_after" in d:
            out.append(
                (f"stage 2 - stage 3{' (live <= 1e7)' if bounded else ''}",
                 f"RSS after {_mib(d[key + '_rss_after'])} MiB ({d[key + '_rss_after_fraction']:.0%} of the "
                 f"theoretical saving), peak in training {_mib(d[key + '_peak_rss'])} MiB per rank")
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny base, every case in one set of processes")
    args = parser.parse_args(argv)
    payload = run(args.quick)
    text = table(payload)
    write_results("qlora", payload, text)
    plot(payload)
    print(text)


if __name__ == "__main__":
    main()
