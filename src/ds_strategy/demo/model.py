"""A small GPT (pre-norm transformer decoder, output head tied to the token embedding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``cache`` (generation): this block's attention inputs of the earlier positions, extended in place;
        the new positions attend to them and to each other (causally)."""
        t = x.size(1)
        h = self.ln1(x)
        past = 0
        keys = h
        if cache is not None:
            if cache:
                past = cache[0].size(1)
                keys = torch.cat([cache[0], h], dim=1)
            cache[:] = [keys]
        mask = torch.triu(torch.ones(t, past + t, dtype=torch.bool, device=x.device), diagonal=past + 1)
        x = x + self.attn(h, keys, keys, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's small init: N(0, 1) embeddings tied to the head would start with logits in the tens.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, cache: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Logits of every position of ``idx``; ``cache`` (one list per block, see ``Block.forward``) makes
        ``idx`` the continuation of the positions cached."""
        start = cache[0][0].size(1) if cache and cache[0] else 0
        pos = torch.arange(start, start + idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for n, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache[n])
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, *, do_sample: bool = True
    ) -> torch.Tensor:
        """``idx`` followed by ``max_new_tokens`` tokens, sampled (``do_sample``) or greedy. While the sequence
        fits ``block_size`` each step runs the new token only, on a cache of the attention inputs; beyond
        it every step reruns the last ``block_size`` tokens."""
        cache: list[list[torch.Tensor]] | None = (
            [[] for _ in self.blocks] if idx.size(1) + max_new_tokens <= self.cfg.block_size else None
        )
        step_input = idx
        for _ in range(max_new_tokens):
            if cache is None:
                step_input = idx[:, -self.cfg.block_size :]
            logits = self(step_input, cache)[:, -1]
            if do_sample:
                token = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1)
            else:
                token = logits.argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, token], dim=1)
            step_input = token
        return idx
