"""A small GPT (pre-norm transformer decoder, output head tied to the token embedding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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


@dataclass
class KVCache:
    """One block's attention keys and values of the positions so far, (batch, heads, positions, head dim),
    written into buffers sized once for the whole generation (``capacity`` positions) rather than
    concatenated anew at every token."""

    capacity: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    length: int = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' ``k`` and ``v``; return the keys and values of every position so far."""
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KVCache: {end} positions exceed its capacity of {self.capacity}")
        if self.keys is None or self.values is None:
            self.keys = k.new_empty(*k.shape[:2], self.capacity, k.size(3))
            self.values = v.new_empty(*v.shape[:2], self.capacity, v.size(3))
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class CachedSelfAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` (batch first, same parameters and training path) that can also attend with a
    key/value cache: generation then projects only the new positions, not every earlier one again.

    The cached path runs inside this module's own ``forward``, so ZeRO stage 3 gathers the weights it reads
    (this module's and ``out_proj``'s) as it does for the plain path."""

    def forward(
        self, query: torch.Tensor, *args: Any, kv_cache: KVCache | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if kv_cache is None:
            return super().forward(query, *args, **kwargs)
        b, t, _ = query.shape
        # Heads counted from the projection's width (not num_heads): tensor-parallel generation gives each
        # rank a slice of them (runtime/inference_tp.py).
        q, k, v = (
            y.view(b, t, -1, self.head_dim).transpose(1, 2)
            for y in F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        )
        past = kv_cache.length
        k, v = kv_cache.extend(k, v)
        # True = may attend: every cached position, and the new ones causally among themselves (one new
        # position, the usual decoding step, attends to everything: no mask).
        allowed = None if t == 1 else torch.ones(t, past + t, dtype=torch.bool, device=query.device).tril(past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1)), None


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CachedSelfAttention(cfg.n_embd, cfg.n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """``cache`` (generation): this block's attention keys and values of the earlier positions, extended
        in place; the new positions attend to them and to each other (causally)."""
        h = self.ln1(x)
        if cache is None:
            t = x.size(1)
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        else:
            x = x + self.attn(h, kv_cache=cache)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    # How generation splits over hybrid_engine.inference_tp_size ranks (runtime/inference_tp.py): each rank
    # keeps its heads of the packed q/k/v projection and its columns of the MLP's first layer; the layers
    # after them read those shares and their partial sums are added across the ranks.
    tp_plan: ClassVar[dict[str, str]] = {
        "blocks.*.attn": "packed_qkv_colwise",
        "blocks.*.attn.out_proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }

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

    def forward(self, idx: torch.Tensor, cache: list[KVCache] | None = None) -> torch.Tensor:
        """Logits of every position of ``idx``; ``cache`` (one ``KVCache`` per block) makes ``idx`` the
        continuation of the positions cached."""
        start = cache[0].length if cache else 0
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
        fits ``block_size`` each step runs the new token only, on a cache of the attention keys and values;
        beyond it every step reruns the last ``block_size`` tokens (through a fresh cache: generation always
        takes the cached attention path, the one tensor-parallel generation can split)."""
        total = idx.size(1) + max_new_tokens
        windowed = total > self.cfg.block_size
        cache = [KVCache(min(total, self.cfg.block_size)) for _ in self.blocks]
        step_input = idx
        for _ in range(max_new_tokens):
            if windowed:
                step_input = idx[:, -self.cfg.block_size :]
                cache = [KVCache(self.cfg.block_size) for _ in self.blocks]
            logits = self(step_input, cache)[:, -1]
            if do_sample:
                token = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1)
            else:
                token = logits.argmax(dim=-1, keepdim=True)
            idx = torch.cat([idx, token], dim=1)
            step_input = token
        return idx
