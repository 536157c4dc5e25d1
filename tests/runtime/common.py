"""Shared pieces of the engine tests: a small model, deterministic data and single-process references."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Net(nn.Module):
    """2-layer MLP with a LayerNorm, a frozen bias and a never-used Linear (its parameters get no grad)."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.ln = nn.LayerNorm(d_hidden)
        self.unused = nn.Linear(4, 4)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.frozen = nn.Parameter(torch.randn(d_out), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.gelu(self.ln(self.fc1(x)))) + self.frozen
        return F.mse_loss(out.float(), y.float())


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def groups_of(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """Two param groups: matrices with weight decay, vectors without (the usual GPT split)."""
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if p.ndim != 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def batches(
    steps: int, rows: int, seed: int = 1, d_in: int = 16, d_out: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch per optimizer step: ``rows`` = micro x world x accumulation rows."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d_in, generator=g) * 2, torch.randn(rows, d_out, generator=g)) for _ in range(steps)]


def micro_slice(
    batch: tuple[torch.Tensor, torch.Tensor], micro: int, world: int, m: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of micro-step ``m`` on ``rank``: the global batch is [micro-step][rank][row]."""
    start = (m * world + rank) * micro
    return batch[0][start : start + micro], batch[1][start : start + micro]


@dataclass
class Trace:
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # compute-dtype weights, fp32 copies
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 master weights


def reference_run(
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    precision: str,
    micro: int,
    world: int,
    gas: int,
    lr: float,
    clip: float,
    loss_scale: float = 1.0,
    weight_decay: float = 0.1,
) -> Trace:
    """Single-process reference with the same global batches.

    fp32: plain PyTorch - one forward/backward over the whole global batch, torch AdamW, clip_grad_norm_.
    bf16/fp16: the same 16-bit compute the engine does, with fp32 master weights: each (micro-step,
    rank) slice runs forward/backward in 16 bits on its own (the loss scaled by ``loss_scale``/gas), the
    16-bit gradients are summed in fp32 and averaged over ranks, then clip + AdamW on the fp32 masters,
    which are cast back into the 16-bit model. A 16-bit backward over the whole batch would round
    differently from per-rank backwards, so only this reference can be compared tightly.
    """
    trace = Trace()
    masters = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups_of(masters, weight_decay), lr=lr)
    dtype = DTYPES[precision]
    compute = masters if precision == "fp32" else copy.deepcopy(masters).to(dtype)
    trainable = [(n, p) for n, p in masters.named_parameters() if p.requires_grad]
    for batch in data:
        if precision == "fp32":
            loss = compute(*batch)
            loss.backward()
            trace.losses.append(loss.item())
        else:
            acc = {n: torch.zeros_like(p) for n, p in trainable}
            total = 0.0
            for m in range(gas):
                for r in range(world):
                    x, y = micro_slice(batch, micro, world, m, r)
                    loss = compute(_cast(x, dtype), _cast(y, dtype))
                    total += loss.item()
                    (loss.float() * (loss_scale / gas)).backward()
                    for n, p in compute.named_parameters():
                        if p.grad is not None:
                            acc[n] += p.grad.float()
                            p.grad = None
            for n, p in trainable:
                p.grad = acc[n] * (1.0 / world / loss_scale)
            trace.losses.append(total / (gas * world))
        for _, p in trainable:
            if p.grad is None:  # never-used parameters: the engine's flat gradient holds zeros there
                p.grad = torch.zeros_like(p)
        trace.norms.append(
            float(torch.nn.utils.clip_grad_norm_([p for _, p in trainable], clip if clip > 0 else float("inf")))
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if compute is not masters:
            with torch.no_grad():
                for (_, src), dst in zip(masters.named_parameters(), compute.parameters(), strict=True):
                    dst.copy_(src)
    trace.params = {n: p.detach().float().clone() for n, p in compute.named_parameters()}
    trace.masters = {n: p.detach().clone() for n, p in masters.named_parameters()}
    return trace


def full_masters(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master, assembled from all ranks' shards through the layout."""
    out: dict[str, torch.Tensor] = {}
    for gs, masters in zip(engine.stage.groups, engine.stage.masters, strict=True):
        layout = gs.layout
        if not gs.partitioned:
            for slot in layout.params:
                bucket = layout.buckets[slot.bucket]
                data = masters[slot.bucket].detach()[slot.offset - bucket.start : slot.end - bucket.start]
                out[slot.name] = data.float().clone().view(slot.shape)
            continue
        partition = torch.cat([m.detach().float().cpu() for m in masters]) if masters else torch.zeros(0)
        full = {slot.name: torch.zeros(slot.numel) for slot in layout.params}
        for piece in layout.shard_pieces(engine.dp_rank):
            slot = layout.params[piece.param]
            full[slot.name][piece.param_offset : piece.param_offset + piece.numel] = partition[
                piece.partition_offset : piece.partition_offset + piece.numel
            ]
        for slot in layout.params:
            dist.all_reduce(full[slot.name])
            out[slot.name] = full[slot.name].view(slot.shape)
    return out


def engine_run(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]], *, micro: int, gas: int) -> Trace:
    """Train ``engine`` on this rank's slices of ``data``; losses are the global mean (all-reduced)."""
    trace = Trace()
    world, rank = engine.dp_world_size, engine.dp_rank
    for batch in data:
        total = torch.zeros(())
        for m in range(gas):
            loss = engine(*micro_slice(batch, micro, world, m, rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        trace.losses.append(total.item() / (gas * world))
        trace.norms.append(float(engine.get_global_grad_norm()))
    from ds_strategy.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # stage 3: whole for the copy; else a no-op
        trace.params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    with engine.stage.resident():  # NVMe offload: the masters in memory for the copy; else a no-op
        trace.masters = full_masters(engine)
    return trace


def config(
    *,
    stage: int,
    precision: str = "fp32",
    offload: bool = False,
    micro: int = 2,
    gas: int = 2,
    lr: float = 1e-2,
    clip: float = 0.0,
    bucket: int = 200,
    overlap: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": overlap,
            "offload_optimizer": {"device": "cpu" if offload else "none"},
        },
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if precision != "fp32":
        # The references reduce gradients in fp32; the engine's default (DeepSpeed's) is the compute dtype,
        # tested on its own in test_config_effects.py.
        cfg["communication_data_type"] = "fp32"
    cfg.update(extra)
    if precision == "fp16":  # the data is fp32: let the engine cast it (DeepSpeed's fp16.auto_cast)
        cfg["fp16"].setdefault("auto_cast", True)
    return cfg


class TiedNet(nn.Module):
    """A tiny language model for stage 3: the output head shares the embedding's weight, one block and a
    LayerNorm are called twice per forward, plus a frozen parameter, a buffer and a never-used Linear."""

    def __init__(self, vocab: int = 24, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(torch.randn(vocab, d) * 0.1, freeze=False)  # tame logits
        self.block = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.randn(vocab) * 0.1, requires_grad=False)
        self.register_buffer("pos", torch.randn(8, d) * 0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = h + self.block(h)
        h = h + self.block(self.ln(h))
        logits = self.head(self.ln(h)) + self.frozen
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_tied(seed: int = 0) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def token_batches(
    steps: int, rows: int, seed: int = 1, vocab: int = 24, seq: int = 6
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids (inputs, targets) per optimizer step, ``rows`` = micro x world x accumulation rows."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(0, vocab, (rows, seq), generator=g))
        for _ in range(steps)
    ]


def tiny_llama() -> Any:
    """A 2-layer Llama built from a config (seed 0) whose generate never stops early: max_new_tokens decides
    the length. Skips the test without transformers."""
    import pytest

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # never stop early: max_new_tokens decides the length
    return model


def causal_lm_reference(model: nn.Module, data: list[torch.Tensor], lr: float = 1e-2) -> list[float]:
    """The single-process losses of a Hugging Face causal LM trained on ``data`` (labels = inputs) by
    torch's AdamW over its trainable parameters (no weight decay)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def llama_prompt(rank: int) -> torch.Tensor:
    """Rank ``rank``'s prompt for ``tiny_llama``: 5 + rank tokens."""
    return torch.randint(1, 64, (1, 5 + rank), generator=torch.Generator().manual_seed(rank))


@contextlib.contextmanager
def runtime_log_messages(level: int | None = None) -> Iterator[list[str]]:
    """The messages logged on ``ds_strategy.runtime`` inside the block (its level set to ``level`` there,
    when given)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ds_strategy.runtime")
    before = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
