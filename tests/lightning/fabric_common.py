"""Pieces of the Fabric tests: a tiny GPT (LitGPT-style), a tiny GAN, their data, and Fabric inside the
harness's workers.

The workers get the environment torchrun would set (``ELASTIC_ENV``), so ``fabric.launch()`` finds an
already-launched 2-process job and launches nothing: a Fabric run costs well under a second.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 32, 8, 16, 2, 2
BATCH = 4  # sequences per rank and micro-batch


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(EMBD, 3 * EMBD)
        self.proj = nn.Linear(EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.norm_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class TinyGPT(nn.Module):
    """LitGPT's shape in miniature: token + position embeddings, pre-norm blocks, tied-free LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def token_batches(steps: int, micro: int, rank: int, world: int) -> list[list[torch.Tensor]]:
    """``steps`` x ``micro`` batches of (BATCH, BLOCK + 1) tokens for ``rank``; with ``world=1`` and
    ``rank=0`` the union of every rank's batch (a 1-process run sees the same global batch)."""
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, VOCAB, (steps, micro, 2 * BATCH, BLOCK + 1), generator=g)
    if world == 1:
        return [list(step) for step in data]
    return [[m[rank * BATCH : (rank + 1) * BATCH] for m in step] for step in data]


def lm_loss(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_fabric(strategy: Any, world: int, precision: str = "32-true") -> Fabric:
    import ds_strategy  # noqa: F401  (what a user's script does: registers "zero3" & co. with Fabric)

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def gpt_loop(
    fabric: Fabric,
    model: Any,
    optimizer: Any,
    batches: list[list[torch.Tensor]],
    max_norm: float | None = None,
) -> dict[str, list[float]]:
    """The LitGPT pretraining loop's core: micro-batches accumulate without sync, the loss is divided by
    their number, clip, step, zero_grad. Returns per-step mean losses and gradient norms."""
    losses, norms = [], []
    for step in batches:
        total = 0.0
        for i, tokens in enumerate(step):
            accumulating = i < len(step) - 1
            with fabric.no_backward_sync(model, enabled=accumulating):
                loss = lm_loss(model, tokens)
                fabric.backward(loss / len(step))
            total += loss.item() / len(step)
        if max_norm is not None:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms}


# ---------------------------------------------------------------------- the GAN
NOISE, FEATURES = 4, 6


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(NOISE, 16), nn.Tanh(), nn.Linear(16, FEATURES))


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def gan_loop(fabric: Fabric, g: Any, d: Any, opt_g: Any, opt_d: Any, steps: int, rank: int) -> dict[str, list[float]]:
    """The classic alternating loop: the generator's loss back-propagates through the discriminator, whose
    gradients from that pass must be dropped by ``opt_d.zero_grad()`` before its own update."""
    gen = torch.Generator().manual_seed(99 + rank)
    out: dict[str, list[float]] = {"d": [], "g": []}
    for _ in range(steps):
        real = torch.randn(8, FEATURES, generator=gen) * 0.5 + 1.0
        z = torch.randn(8, NOISE, generator=gen)
        opt_d.zero_grad()
        fake = g(z).detach()
        logits = d(torch.cat([real, fake]))
        target = torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])
        loss_d = F.binary_cross_entropy_with_logits(logits, target)
        fabric.backward(loss_d, model=d)
        opt_d.step()
        opt_g.zero_grad()
        loss_g = F.binary_cross_entropy_with_logits(d(g(z)), torch.ones(8, 1))
        fabric.backward(loss_g, model=g)
        opt_g.step()
        out["d"].append(loss_d.item())
        out["g"].append(loss_g.item())
    return out


def assert_close_lists(got: list[float], ref: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(ref), what
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-7), f"{what}[{i}]: {a} vs {b} (rtol {rtol})"
