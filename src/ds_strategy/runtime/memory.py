"""``estimate_memory``: what one rank holds for the model states at a given ZeRO stage and precision.

Bytes per trainable parameter (N parameters, W data-parallel ranks), matching what the engine
allocates (``engine.memory_breakdown()`` measures the same categories):

| category        | stage 0                  | stage 1                        | stage 2        | stage 3        |
| --------------- | ------------------------ | ------------------------------ | -------------- | -------------- |
| params          | c N                      | c N                            | c N            | c N / W        |
| grads           | a N                      | a N + 4 N / W                  | 4 N / W        | 4 N / W        |
| master (fp32)   | 4 N, 0 when fp32         | 4 N / W, 0 when fp32 in place  | as stage 1     | as stage 1     |
| optimizer state | 4 s N                    | 4 s N / W                      | 4 s N / W      | 4 s N / W      |

c = compute-dtype size (4 fp32, 2 bf16/fp16), a = gradient-accumulation dtype size (4), s = states per
element (Adam/AdamW 2, Adagrad/Lion/SGD-with-momentum 1). With optimizer offload the master and the
optimizer state live in host memory (``offloaded``); fp32 masters are separate copies then, except when
the compute device is the CPU itself. Stage 2's transient bucket buffers (at most ``reduce_bucket_size``
elements in flight) and bucket padding (< world_size x 16 elements per bucket) are not counted, nor stage
3's gathered buckets (at most ``stage3_max_live_parameters`` elements, plus the largest module) and its
persistent parameters (whole on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2}
_STATES = {"adam": 2, "adamw": 2, "adagrad": 1, "lion": 1, "sgd": 1}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of the model states."""

    params: int
    grads: int
    master: int
    optimizer_state: int
    offloaded: int  # of master + optimizer_state, the bytes kept in host memory

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_state

    @property
    def on_device(self) -> int:
        return self.total - self.offloaded

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "master": self.master,
            "optimizer_state": self.optimizer_state,
        }


def estimate_memory(
    model_or_num_params: nn.Module | int,
    world_size: int = 1,
    stage: int = 0,
    offload: bool = False,
    precision: str = "fp32",
    *,
    optimizer: str = "Adam",
    device: str = "cuda",
) -> MemoryEstimate:
    """Per-rank bytes of params, grads, fp32 masters and optimizer state (see the table above).

    ``model_or_num_params``: a module (its trainable parameters are counted) or a parameter count.
    ``precision``: "fp32", "bf16" or "fp16". ``device``: the compute device kind ("cuda" or "cpu"; with
    "cpu", offloaded fp32 masters need no separate copy).
    """
    if isinstance(model_or_num_params, nn.Module):
        n = sum(p.numel() for p in model_or_num_params.parameters() if p.requires_grad)
    else:
        n = int(model_or_num_params)
    if precision not in _SIZES:
        raise ValueError(f"precision must be one of {', '.join(_SIZES)}, got {precision!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if offload and stage == 0:
        raise ValueError(
            "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps the optimizer state on every rank)"
        )
    states = _STATES.get(optimizer.lower())
    if states is None:
        raise ValueError(f"optimizer must be one of {', '.join(_STATES)}, got {optimizer!r}")
    c = _SIZES[precision]
    share = n if stage == 0 else n // world_size
    params = c * share if stage == 3 else c * n  # stage 3: at rest (+ gathered buckets in flight, persistent)
    grads = {0: 4 * n, 1: 4 * n + 4 * share, 2: 4 * share, 3: 4 * share}[stage]
    in_place = precision == "fp32" and (not offload or device == "cpu")
    master = 0 if in_place else 4 * share
    optimizer_state = 4 * states * share
    offloaded = master + optimizer_state if offload else 0
    return MemoryEstimate(params, grads, master, optimizer_state, offloaded)
