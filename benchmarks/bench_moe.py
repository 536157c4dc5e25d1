"""Mixture of experts on CPU ranks: the all-to-all (our shared-memory kernel vs gloo) at 1, 16 and 128 MB on
2 and 4 ranks, and a small MoE GPT's step time and per-rank memory at ep_size 1 vs 2 (2 ranks, ZeRO stage
2), beside DeepSpeed's MoE layer and engine on the same model and config where it runs here.
Writes benchmarks/results/moe.{json,md,png}.

    python -m benchmarks.run_all moe            # or: python -m benchmarks.bench_moe [--quick]

all-to-all: S = the bytes each rank sends (its whole input), algbw = S / t, busbw = algbw * (W-1)/W
(nccl-tests). Each timing is the best of interleaved rounds (shm and gloo alternate, so load from other
processes on this shared machine hits both alike).

MoE GPT: embedding, 2 blocks (attention + an MoE feed-forward of 4 experts, top-1, capacity factor 1.25),
vocabulary 512, width 128, sequence 64, micro batch 4 per rank, AdamW, fp32. Step = forward + backward +
step, median of the timed steps. Memory per rank: the bytes of the parameters, gradients, masters and
optimizer state the rank holds (the engine's ``memory_breakdown``; for DeepSpeed the same tensors counted
from its optimizer) and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common import machine, markdown_table, peak_rss_bytes, results_dir, run_ranks, write_results

SIZES_MB = (1, 16, 128)
WORLDS = (2, 4)
MB = 1 << 20
VOCAB, WIDTH, SEQ, MICRO, EXPERTS = 512, 128, 64, 4, 4


# ---------------------------------------------------------------------------------------------- all-to-all
def _a2a_rank(rank: int, world: int, sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    from ds_strategy.comm import Communicator

    shm = Communicator()
    gloo = Communicator(fast_path=False)
    rows = []
    try:
        for mb in sizes:
            n = mb * MB // 4 // world * world
            x = torch.randn(n)
            out = torch.empty_like(x)
            impls = {
                "shm": lambda c=shm, o=out, i=x: c.all_to_all_single(o, i),
                "gloo": lambda c=gloo, o=out, i=x: c.all_to_all_single(o, i),
            }
            if shm.fast_path is None:
                impls.pop("shm")
            iters = max(1, min(50, (16 if quick else 128) // mb))
            best = dict.fromkeys(impls, float("inf"))
            for fn in impls.values():
                fn()
            for _ in range(2 if quick else 5):
                for name, fn in impls.items():
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    best[name] = min(best[name], (time.perf_counter() - start) / iters)
            for name, sec in best.items():
                algbw = n * 4 / sec / 1e9
                rows.append({"world": world, "MB": mb, "impl": name, "ms": sec * 1e3, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * (world - 1) / world})  # fmt: skip
    finally:
        shm.close()
        gloo.close()
    return rows


# ------------------------------------------------------------------------------------------------ MoE GPT
class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, moe_cls: Any, ep_size: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.moe = moe_cls(WIDTH, _Expert(), num_experts=EXPERTS, ep_size=ep_size, k=1, capacity_factor=1.25,
                           min_capacity=4)  # fmt: skip

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class _MoEGPT(nn.Module):
    def __init__(self, moe_cls: Any, ep_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        self.blocks = nn.ModuleList([_Block(moe_cls, ep_size) for _ in range(2)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids[:, :-1]) + self.pos[: ids.shape[1] - 1]
        aux = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x, self.mask[: x.shape[1], : x.shape[1]])
            aux = aux + l_aux
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + 0.01 * aux


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }


def _gpt_rank(rank: int, world: int, impl: str, ep_size: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    if impl == "ds_strategy":
        import ds_strategy
        from ds_strategy.moe import MoE

        model = _MoEGPT(MoE, ep_size)
        engine, *_ = ds_strategy.initialize(model=model, config=_config())
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed.moe.layer import MoE as DSMoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        deepspeed.init_distributed(dist_backend="gloo")
        model = _MoEGPT(DSMoE, ep_size)
        groups = split({"params": list(model.parameters()), "name": "dense"})
        opt = torch.optim.AdamW(groups, lr=1e-4, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config())
    g = torch.Generator().manual_seed(rank)
    times = []
    for i in range(steps + 2):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if impl == "ds_strategy":
        held = sum(engine.memory_breakdown().values())
    else:
        opt = engine.optimizer
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        inner = getattr(opt, "optimizer", opt)
        held += sum(
            t.numel() * t.element_size()
            for s in inner.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        held += sum(p.numel() * p.element_size() for grp in inner.param_groups for p in grp["params"])  # masters
    return {"step_ms": statistics.median(times) * 1e3, "held_MiB": held / 2**20, "rss_MiB": peak_rss_bytes() / 2**20,
            "expert_params": expert_params}  # fmt: skip


def _gpt_case(impl: str, ep_size: int, steps: int) -> dict[str, Any]:
    try:
        ranks = run_ranks(_gpt_rank, 2, impl, ep_size, steps)
    except Exception as err:  # a peer that cannot run here is reported, not fatal
        return {"impl": impl, "ep_size": ep_size, "error": f"{type(err).__name__}: {str(err)[-300:]}"}
    return {
        "impl": impl,
        "ep_size": ep_size,
        "step_ms": max(r["step_ms"] for r in ranks),
        "held_MiB_per_rank": max(r["held_MiB"] for r in ranks),
        "peak_rss_MiB_per_rank": max(r["rss_MiB"] for r in ranks),
        "expert_params_per_rank": ranks[0]["expert_params"],
    }


# ------------------------------------------------------------------------------------------------ output
def headlines(payload: dict[str, Any]) -> list[tuple[str, str]]:
    by = {(r["world"], r["MB"], r["impl"]): r["ms"] for r in payload["all_to_all"]}
    out = []
    for (world, mb, impl), ms in by.items():
        if impl == "shm" and (world, mb, "gloo") in by:
            out.append(
                (f"all_to_all {world} ranks {mb} MB: shm speed-up vs gloo", f"{by[(world, mb, 'gloo')] / ms:.2f}x")
            )
    gpt = {(c["impl"], c["ep_size"]): c for c in payload["gpt"] if "error" not in c}
    for ep in (1, 2):
        c = gpt.get(("ds_strategy", ep))
        if c is not None:
            ds = gpt.get(("deepspeed", ep))
            peer = f", deepspeed {ds['step_ms']:.0f} ms" if ds else ""
            out.append(
                (f"MoE GPT step ep_size {ep}", f"{c['step_ms']:.0f} ms, {c['held_MiB_per_rank']:.1f} MiB/rank{peer}")
            )
    return out


def _plot(payload: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    labels = [f"{w}r {mb}MB" for w in WORLDS for mb in SIZES_MB]
    for i, impl in enumerate(("shm", "gloo")):
        by = {(r["world"], r["MB"], r["impl"]): r["busbw_GBps"] for r in payload["all_to_all"]}
        ys = [by.get((w, mb, impl), 0) for w in WORLDS for mb in SIZES_MB]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(labels))], ys, width=0.4, label=impl)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("all_to_all bus bandwidth, GB/s")
    ax.legend()
    ax = axes[1]
    cases = [c for c in payload["gpt"] if "error" not in c]
    ax.bar(range(len(cases)), [c["step_ms"] for c in cases])
    ax.set_xticks(range(len(cases)), [f"{c['impl']}\nep {c['ep_size']}" for c in cases], fontsize=8)
    ax.set_ylabel("MoE GPT step, ms (2 ranks, stage 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few steps (smoke run)")
    args = parser.parse_args(argv)
    sizes = [1] if args.quick else list(SIZES_MB)
    a2a: list[dict[str, Any]] = []
    for world in WORLDS[:1] if args.quick else WORLDS:  # a smoke run: one set of processes fewer
        a2a += run_ranks(_a2a_rank, world, sizes, args.quick)[0]
    steps = 2 if args.quick else 10
    gpt = [_gpt_case("ds_strategy", 1, steps), _gpt_case("ds_strategy", 2, steps)]
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        gpt += [_gpt_case("deepspeed", 1, steps), _gpt_case("deepspeed", 2, steps)]
    payload = {"machine": machine(), "quick": args.quick, "all_to_all": a2a, "gpt": gpt}
    rows = [[r["world"], r["MB"], r["impl"], f"{r['ms']:.2f}", f"{r['busbw_GBps']:.2f}"] for r in a2a]
    table = "## all_to_all\n\n" + markdown_table(["ranks", "MB", "impl", "ms", "busbw GB/s"], rows)
    grows = [
        [c["impl"], c["ep_size"], c.get("error", f"{c.get('step_ms', 0):.0f}"), f"{c.get('held_MiB_per_rank', 0):.1f}",
         f"{c.get('peak_rss_MiB_per_rank', 0):.0f}", c.get("expert_params_per_rank", "")]
        for c in gpt
    ]  # fmt: skip
    table += "\n\n## MoE GPT, 2 ranks, ZeRO stage 2\n\n" + markdown_table(
        ["impl", "ep_size", "step ms", "held MiB/rank", "peak RSS MiB/rank", "expert params/rank"], grows
    )
    write_results("moe", payload, table)
    _plot(payload, results_dir() / "moe.png")
    print(table)
    print(json.dumps(headlines(payload), indent=1))


if __name__ == "__main__":
    main()
