"""Generate, score, train: an RLHF-flavoured loop on the hybrid engine (ZeRO stage 3, 2 CPU processes).

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/generate_then_train.py
    ds-launch --num_procs 2 examples/generate_then_train.py

Each iteration every rank samples continuations of its own prompts with ``engine.generate`` (stage 3
gathers the partitioned model once for the call: ``hybrid_engine``), scores them with a toy reward (the
share of new tokens equal to TARGET), and takes a REINFORCE step on them: raise the log-probability of the
continuations that scored above the batch mean. The mean reward climbs from chance (1/VOCAB).
See docs/hybrid_engine.md.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_strategy
from ds_strategy.demo.model import GPT, GPTConfig

VOCAB, TARGET, PROMPT, NEW, ITERATIONS = 16, 7, 2, 8, 30

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    # generate gathers the model once per call and keeps it until the optimizer step (pin_parameters)
    "hybrid_engine": {"enabled": True, "pin_parameters": True, "max_out_tokens": PROMPT + NEW},
}


def reward(new_tokens: torch.Tensor) -> torch.Tensor:
    """The share of each sample's new tokens that equal TARGET."""
    return (new_tokens == TARGET).float().mean(dim=1)


def main() -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine, *_ = ds_strategy.initialize(model=model, config=CONFIG)
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # each rank samples its own prompts and continuations
    history = []
    for it in range(ITERATIONS):
        prompts = torch.randint(0, VOCAB, (8, PROMPT))
        engine.eval()
        seq = engine.generate(prompts, NEW, temperature=1.0, do_sample=True)
        scores = reward(seq[:, PROMPT:])
        mean = scores.mean().reshape(1)
        dist.all_reduce(mean)
        history.append(mean.item() / dist.get_world_size())

        engine.train()
        logits = engine(seq[:, :-1])[:, PROMPT - 1 :]  # the predictions of the new tokens
        logp = F.log_softmax(logits.float(), dim=-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1).sum(dim=1)
        loss = -((scores - scores.mean()) * logp).mean()
        engine.backward(loss)
        engine.step()
        if rank == 0 and (it % 5 == 0 or it == ITERATIONS - 1):
            print(f"iteration {it:2d}: mean reward {history[-1]:.3f}", flush=True)
    if rank == 0:
        first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
        print(f"mean reward over 5 iterations: first {first:.3f} -> last {last:.3f}", flush=True)
    engine.destroy()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
