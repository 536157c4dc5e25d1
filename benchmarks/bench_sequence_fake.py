"""The longest sequence that trains on one device at sp 1 against sp 8 (issue 45, criterion 5, the GPU part).

One process stands for rank 0 of 8 under torch's fake process group ([Note: the fake process group] in
comm/distributed.py): the engine, ZeRO-3's partitions, Ulysses' groups and ``shard_batch`` run as at world
size 8, the collectives move nothing, so the device holds what one rank of 8 would (the losses mean nothing).
Against it, a plain process of world size 1 at sp 1. For each, the sequence length doubles until a step
runs out of memory; the peak memory of each length that trained is reported (``max_memory_allocated`` on
CUDA; on the CPU the peak RSS, only as a smoke test).

    python -m benchmarks.bench_sequence_fake --device cuda            # the ~270M Llama, bf16
    python -m benchmarks.bench_sequence_fake --quick                  # a tiny model on the CPU

Writes benchmarks/results/sequence_fake.{json,md} (a results folder of its own with DS_STRATEGY_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from typing import Any

import torch

from benchmarks.bench_sequence_parallel import llama_config
from benchmarks.common import machine, markdown_table, peak_memory_bytes, synchronize, write_results

MIB = 1 << 20
# ~270M parameters: 16 layers of hidden 1024 (16 heads, 8 key/value heads), MLP 2816, vocabulary 32000.
FULL = {"hidden": 1024, "heads": 16, "kv_heads": 8, "layers": 16, "intermediate": 2816, "vocab": 32000}
QUICK = {"hidden": 64, "heads": 8, "kv_heads": 4, "layers": 2, "intermediate": 128, "vocab": 256}


def _one(sp: int, length: int, shape: dict[str, int], device: str, bf16: bool) -> dict[str, Any]:
    """One training step of ``length`` tokens at ``sp`` (fake world ``sp`` when above 1), in this process."""
    import torch.distributed as dist
    import transformers
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import ds_strategy
    from ds_strategy import sequence

    if sp > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    sequence.register()
    config = llama_config(shape, length)
    with ds_strategy.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}}):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="ds_ulysses")
    model.gradient_checkpointing_enable()
    engine, *_ = ds_strategy.initialize(
        model=model,
        device=device,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "sequence_parallel_size": sp,
            "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        },
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, shape["vocab"], (1, length))
    whole = {"input_ids": ids, "labels": ids}
    batch = sequence.shard_batch(whole) if sp > 1 else whole  # sp 1: no layout, the whole sequence
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    synchronize(device)
    peak = peak_memory_bytes(device)
    engine.destroy()
    return {"sp": sp, "length": length, "peak_mib": round(peak / MIB, 1)}


def _child(args: argparse.Namespace) -> None:
    """One (sp, length) in a fresh process: an out-of-memory step leaves nothing behind for the next."""
    shape = QUICK if args.quick else FULL
    try:
        out = _one(args.sp, args.length, shape, args.device, bf16=args.device == "cuda")
    except torch.OutOfMemoryError:
        out = {"sp": args.sp, "length": args.length, "oom": True}
    gc.collect()
    print("RESULT " + json.dumps(out), flush=True)


def _run(sp: int, length: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_sequence_fake", "--child", "--sp", str(sp), "--length", str(length)]
    cmd += ["--device", args.device] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"sp": sp, "length": length, "error": (proc.stderr or proc.stdout)[-600:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="a tiny model, two lengths")
    parser.add_argument("--sps", default="1,8", help="sequence-parallel sizes (above 1: a fake world of that size)")
    parser.add_argument("--start", type=int, default=2048, help="the first length; it doubles from there")
    parser.add_argument("--max-length", type=int, default=1 << 20)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per step process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    start, stop = (256, 512) if args.quick else (args.start, args.max_length)
    rows: list[dict[str, Any]] = []
    for sp in (int(s) for s in args.sps.split(",")):
        length = start
        while length <= stop:
            row = _run(sp, length, args)
            rows.append(row)
            print(row, flush=True)
            if "peak_mib" not in row:
                break
            length *= 2
    longest = {
        str(sp): max((r["length"] for r in rows if r["sp"] == sp and "peak_mib" in r), default=0)
        for sp in {r["sp"] for r in rows}
    }
    payload = {"machine": machine(), "device": args.device, "quick": args.quick, "model": QUICK if args.quick else FULL}
    payload |= {"rows": rows, "longest": longest}
    table = markdown_table(
        ["sp", "length", "peak MiB"],
        [[r["sp"], r["length"], r.get("peak_mib", "out of memory" if r.get("oom") else "error")] for r in rows],
    )
    write_results("sequence_fake", payload, table + f"\n\nLongest sequence that trained: {longest}\n")


if __name__ == "__main__":
    main()
