"""LoRA fine-tuning on 2 CPU ranks (issue 21, criterion 1): what each rank holds after training a ``peft``
LoRA on a frozen Hugging Face Llama base, ds_strategy at ZeRO stages 2 and 3 beside DeepSpeed (when
installed) at the same stages and config.

The base is a Llama-architecture model built from a config (never downloaded): 8 layers, hidden 512,
MLP 1792, vocabulary 32000, untied head: 63M parameters, 253 MB in fp32. Its weights are made once in the
parent (a plain build, Hugging Face's initialisation) and saved; every case loads them, as a fine-tune
loads a pretrained base: stage 2 builds the model whole and loads the file; stage 3 builds it under the
peer's ``zero.Init``; ds_strategy then loads the Hugging Face safetensors copy with ``load_hf_weights``
(each rank reads only its slices), DeepSpeed writes each parameter through
``GatheredParameters(modifier_rank=0)`` (rank 0 reads it from the memory-mapped file): no rank ever holds
the whole base. ``peft.get_peft_model`` then
adds rank-8 adapters to q/k/v/o (seeded alike everywhere) and the engine trains them with AdamW, fp32,
micro batch 2 x 64 tokens per rank, 3 steps. A single-process torch run of the same weights on the global
batch gives the reference losses.

Per rank, after the run (gc'd): RSS (VmRSS), peak RSS (VmHWM) and, for ds_strategy, the bytes its engine
holds (``memory_breakdown``: parameters incl. the frozen partitions, fp32 masters, optimizer state). The
ranks run with ``MALLOC_PERTURB_`` (every allocation written, as a device allocator commits it) and a fixed
``MALLOC_MMAP_THRESHOLD_`` (large blocks are returned to the system when freed, so RSS after the run is
what is still held, not what glibc kept). Derived: stage 3's RSS after the run minus stage 2's, beside
half the frozen base (what partitioning it over 2 ranks saves in theory). Each case in fresh processes.
Writes benchmarks/results/lora.{json,md,png}. ``--quick``: a tiny base (smoke run).

    python -m benchmarks.bench_lora [--quick]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    environment,
    machine,
    markdown_table,
    peak_rss_bytes,
    results_dir,
    run_each,
    write_results,
)

WORLD = 2
SHAPE = {"vocab": 32000, "hidden": 512, "intermediate": 1792, "layers": 8, "heads": 8}
QUICK_SHAPE = {"vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4}
SEQ, MICRO, STEPS, LR = 64, 2, 3, 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MALLOC_ENV = {"MALLOC_PERTURB_": "165", "MALLOC_MMAP_THRESHOLD_": "131072"}
BOUNDED = {
    "stage3_max_live_parameters": 10**7,
    "stage3_max_reuse_distance": 10**7,
    "stage3_prefetch_bucket_size": 10**7,
}
Case = tuple[str, int, bool]  # (peer, stage, bounded: the BOUNDED stage-3 keys instead of the defaults)


def build_base(shape: dict[str, int]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def add_lora(base: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' initialisation, alike in every case and the reference
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))


def batches(shape: dict[str, int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, shape["vocab"], (MICRO * WORLD, SEQ), generator=g) for _ in range(STEPS)]


def ds_config(stage: int, bounded: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, **(BOUNDED if bounded else {}))
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def reference_losses(base_path: str, shape: dict[str, int]) -> list[float]:
    """Single-process torch: the same weights and adapters, the global batch, torch.optim.AdamW."""
    base = build_base(shape)
    base.load_state_dict(torch.load(base_path, mmap=True, weights_only=True))
    model = add_lora(base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for ids in batches(shape):
        # Each rank's loss is its micro batch's mean; the engines average the ranks' gradients.
        loss = torch.stack([model(input_ids=h, labels=h).loss for h in ids.chunk(WORLD)]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _load_partitioned(lib: Any, base: torch.nn.Module, base_path: str, rank: int) -> None:
    """Write the saved weights into a base built under ``lib.zero.Init``, one parameter gathered at a time."""
    state = torch.load(base_path, mmap=True, weights_only=True) if rank == 0 else {}
    for name, p in base.named_parameters():
        with lib.zero.GatheredParameters([p], modifier_rank=0):
            if rank == 0:
                p.data.copy_(state[name])
    del state


def _hf_dir(base_path: str) -> str:
    return str(Path(base_path).with_suffix("")) + "-hf"


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _run_one(rank: int, world: int, case: Case, shape: dict[str, int], base_path: str) -> dict[str, Any]:
    import peft  # noqa: F401  (imported before DeepSpeed's zero.Init patches torch's tensor constructors)
    import torch.distributed as dist
    import transformers.models.llama.modeling_llama  # noqa: F401

    peer, stage, bounded = case
    if peer == "deepspeed":
        import deepspeed as lib
    else:
        import ds_strategy as lib  # type: ignore[no-redef]
    torch.manual_seed(0)
    if stage == 3:
        with lib.zero.Init():
            base = build_base(shape)
        if peer == "ds_strategy":  # each rank reads only its slices of the safetensors file
            from ds_strategy.utils import load_hf_weights

            load_hf_weights(base, _hf_dir(base_path))
        else:
            _load_partitioned(lib, base, base_path, rank)
    else:
        base = build_base(shape)
        base.load_state_dict(torch.load(base_path, mmap=True, weights_only=True))
    model = add_lora(base)
    frozen = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = lib.initialize(model=model, model_parameters=trainable, config=ds_config(stage, bounded))
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
    out: dict[str, Any] = {"losses": losses, "rss_before_trim": _rss_bytes()}
    if peer == "ds_strategy":
        from ds_strategy.runtime import host_memory

        # Stage 3's gathered buckets come from a pool that keeps the step's peak working set cached for the
        # next step (what torch's CUDA caching allocator does on a GPU); trimmed, RSS shows what is held.
        out["pool_cached"] = host_memory.pool_stats()[1]
        host_memory.trim()
    out.update(
        rss_after=_rss_bytes(),
        peak_rss=peak_rss_bytes(),
        frozen_params=frozen,
        adapter_params=sum(p.numel() for p in trainable),
    )
    if peer == "ds_strategy":
        out["engine_bytes"] = engine.memory_breakdown()
    return out


def run(quick: bool) -> dict[str, Any]:
    shape = QUICK_SHAPE if quick else SHAPE
    peers = ["ds_strategy"] + (["deepspeed"] if importlib.util.find_spec("deepspeed") is not None else [])
    kinds = ((2, False), (3, False), (3, True))
    cases: list[Case] = [(peer, stage, bounded) for peer in peers for stage, bounded in kinds]
    with environment(MALLOC_ENV):  # the spawned ranks inherit it (restored for later benchmarks)
        return _run(quick, shape, cases)


def _run(quick: bool, shape: dict[str, int], cases: list[Case]) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base_path = str(Path(tmp) / "base.pt")
        torch.manual_seed(0)
        base = build_base(shape)
        torch.save(base.state_dict(), base_path)
        base.save_pretrained(_hf_dir(base_path))  # what ds_strategy's stage 3 loads (load_hf_weights)
        del base
        ref = reference_losses(base_path, shape)
        for (peer, stage, bounded), per_rank in run_each(_run_one, WORLD, cases, shape, base_path, fresh=not quick):
            name = f"{peer} stage {stage}" + (" (live <= 1e7)" if bounded else "")
            record: dict[str, Any] = {"case": name, "peer": peer, "stage": stage, "bounded": bounded}
            if isinstance(per_rank, Exception):
                print(f"{record['case']}: failed: {per_rank}", flush=True)
                records.append({**record, "error": str(per_rank)})
                continue
            losses = per_rank[0]["losses"]
            record.update(
                ranks=per_rank,
                rss_after=max(r["rss_after"] for r in per_rank),
                rss_before_trim=max(r["rss_before_trim"] for r in per_rank),
                pool_cached=max(r.get("pool_cached", 0) for r in per_rank),
                peak_rss=max(r["peak_rss"] for r in per_rank),
                losses=losses,
                max_loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)),
            )
            records.append(record)
            print(f"{record['case']}: RSS after {record['rss_after'] / 2**20:.0f} MiB/rank", flush=True)
    frozen_bytes = 4 * next(r["ranks"][0]["frozen_params"] for r in records if "ranks" in r)
    derived: dict[str, Any] = {"half_frozen_base_bytes": frozen_bytes / WORLD}
    by = {(r["peer"], r["stage"], r["bounded"]): r for r in records if "error" not in r}
    for peer in ("ds_strategy", "deepspeed"):
        for bounded in (False, True):
            if (peer, 2, False) in by and (peer, 3, bounded) in by:
                three, two = by[(peer, 3, bounded)], by[(peer, 2, False)]
                key = f"{peer}_stage3{'_bounded' if bounded else ''}_minus_stage2"
                derived[key + "_rss_after"] = three["rss_after"] - two["rss_after"]
                derived[key + "_peak_rss"] = three["peak_rss"] - two["peak_rss"]
    return {
        "machine": machine(),
        "quick": quick,
        "shape": shape,
        "world_size": WORLD,
        "malloc_env": MALLOC_ENV,
        "frozen_base_bytes": frozen_bytes,
        "reference_losses": ref,
        "cases": records,
        "derived": derived,
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f}"


def table(payload: dict[str, Any]) -> str:
    rows = []
    for r in payload["cases"]:
        if "error" in r:
            rows.append((r["case"], "failed", "", "", "", "", r["error"].strip().splitlines()[-1][:100]))
            continue
        held = r["ranks"][0].get("engine_bytes")
        held_text = "" if held is None else f"{_mib(held['params'])} / {_mib(held['master'] + held['optimizer_state'])}"
        cached = f"{_mib(r['pool_cached'])}" if r["peer"] == "ds_strategy" and r["stage"] == 3 else ""
        rows.append(
            (r["case"], _mib(r["rss_after"]), _mib(r["peak_rss"]), held_text, cached,
             f"{r['max_loss_rel_diff']:.1e}", "")
        )  # fmt: skip
    cols = ("case", "RSS after (MiB/rank)", "peak RSS (MiB/rank)", "engine: params / masters+optimizer (MiB)",
            "gathered-bucket cache trimmed (MiB)", "loss vs torch (max rel.)", "note")  # fmt: skip
    d = payload["derived"]
    lines = [
        f"LoRA (r=8, q/k/v/o) on a {payload['frozen_base_bytes'] / 1e6:.0f} MB frozen Llama base, "
        f"{payload['world_size']} ranks, fp32, AdamW, {STEPS} steps.",
        "",
        markdown_table(cols, rows),
        "",
        f"Half the frozen base: {_mib(d['half_frozen_base_bytes'])} MiB.",
    ]
    for peer in ("ds_strategy", "deepspeed"):
        for bounded in ("", "_bounded"):
            key = f"{peer}_stage3{bounded}_minus_stage2"
            if key + "_rss_after" in d:
                lines.append(
                    f"{peer}: stage 3{' (live <= 1e7)' if bounded else ''} minus stage 2: RSS after the run "
                    f"{_mib(d[key + '_rss_after'])} MiB, peak RSS {_mib(d[key + '_peak_rss'])} MiB per rank."
                )
    return "\n".join(lines)


def plot(payload: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in payload["cases"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["case"] for r in ok]
    x = range(len(ok))
    ax.bar([i - 0.2 for i in x], [r["rss_after"] / 2**20 for r in ok], 0.4, label="RSS after the run")
    ax.bar([i + 0.2 for i in x], [r["peak_rss"] / 2**20 for r in ok], 0.4, label="peak RSS")
    ax.axhline(payload["frozen_base_bytes"] / 2**20, color="gray", ls="--", lw=1, label="whole frozen base")
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("MiB per rank")
    ax.set_title("LoRA on a frozen Llama base, 2 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results_dir() / "lora.png", dpi=120)
    plt.close(fig)


def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) pairs for benchmarks/results/summary.md."""
    d = payload["derived"]
    out = [("half the frozen base", f"{_mib(d['half_frozen_base_bytes'])} MiB")]
    for peer in ("ds_strategy", "deepspeed"):
        for bounded in ("", "_bounded"):
            key = f"{peer}_stage3{bounded}_minus_stage2"
            if key + "_rss_after" in d:
                out.append(
                    (f"{peer}: stage 3{' (live <= 1e7)' if bounded else ''} - stage 2",
                     f"RSS after {_mib(d[key + '_rss_after'])} MiB, peak {_mib(d[key + '_peak_rss'])} MiB per rank")
                )  # fmt: skip
    for r in payload["cases"]:
        if "error" not in r:
            out.append((f"{r['case']}: loss vs single-process torch", f"{r['max_loss_rel_diff']:.1e} max rel."))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny base, every case in one set of processes")
    args = parser.parse_args(argv)
    payload = run(args.quick)
    text = table(payload)
    write_results("lora", payload, text)
    plot(payload)
    print(text)


if __name__ == "__main__":
    main()
