"""``python -m ds_strategy.demo``: train a small GPT on pydoc's topics on 2 CPU processes.

For now the run uses Lightning's DDP with our fused global-norm kernel for gradient monitoring and
overflow detection; it grows into the ZeRO strategies as they land.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from ds_strategy.demo.data import VOCAB_SIZE, CharDataset, corpus_text, decode
from ds_strategy.demo.model import GPT, GPTConfig
from ds_strategy.ops import load_cpu_kernels, multi_tensor_l2norm


class GPTModule(L.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.lr = lr
        self.losses: list[float] = []
        self.started = 0.0
        self.tokens = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            self.started = time.perf_counter()
        idx, targets = batch
        loss = self.model.loss(idx, targets)
        self.tokens += idx.numel()
        self.losses.append(loss.item())
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # One fused pass over every gradient: global L2 norm and inf/nan detection.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm, found_inf = multi_tensor_l2norm(grads)
        if found_inf.item():
            raise FloatingPointError(f"non-finite gradient at step {self.global_step}")
        self.log("grad_norm", norm, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ds_strategy.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps (default 80)")
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="micro batch per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(0, verbose=False)
    cfg = GPTConfig(vocab_size=VOCAB_SIZE)
    dataset = CharDataset(corpus_text(), cfg.block_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=0, drop_last=True)
    module = GPTModule(cfg, args.lr)
    kernels = load_cpu_kernels()  # build once in the launching process; the workers load it from the cache
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    if trainer.is_global_zero:
        _summary(module, args, kernels)


def _summary(module: GPTModule, args: argparse.Namespace, kernels: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    elapsed = time.perf_counter() - module.started
    isa = torch.ops.ds_strategy.simd_isa() if kernels else "fallback (no compiler)"
    table = Table(title="ds_strategy demo: small GPT on pydoc topics, CPU")
    for col in ("processes", "steps", "first loss", "last loss", "tokens/s (all ranks)", "peak RSS rank 0", "kernel"):
        table.add_column(col)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    table.add_row(
        str(args.devices),
        str(len(module.losses)),
        f"{module.losses[0]:.3f}",
        f"{sum(module.losses[-10:]) / len(module.losses[-10:]):.3f}",
        f"{module.tokens * args.devices / elapsed:,.0f}",
        f"{peak_mb:,.0f} MB",
        isa,
    )
    Console().print(table)
    prompt = torch.tensor([list(b"def ")])
    sample = module.model.eval().generate(prompt, 120)
    Console().print(f"[bold]sample:[/bold] {decode(sample[0].tolist())!r}")


if __name__ == "__main__":
    main()
