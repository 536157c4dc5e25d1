"""The memory model: what one rank holds at a given ZeRO stage, precision and offload, at its peak.

``estimate_memory`` counts the model states (``total``, ``on_device``, ``as_dict``: what
``engine.memory_breakdown()`` measures) and, given what only a run of the model can tell (activation bytes
per sample, the largest stage-3 fetch unit), the transient terms of a training step (``peak``,
``peak_on_device``). The autotuner prunes configurations with it; tests/runtime/test_memory_model.py checks
``peak`` against a measured peak (docs/memory.md).

Bytes per trainable parameter (N parameters, W data-parallel ranks):

| term            | stage 0                | stage 1                        | stage 2    | stage 3              |
| --------------- | ---------------------- | ------------------------------ | ---------- | -------------------- |
| params          | c N                    | c N                            | c N        | c N / W              |
| grads           | a N                    | a N + 4 N / W                  | 4 N / W    | 4 N / W              |
| master (fp32)   | 4 N, 0 when fp32       | 4 N / W, 0 when fp32 in place  | as stage 1 | as stage 1           |
| optimizer state | 4 s N                  | 4 s N / W                      | 4 s N / W  | 4 s N / W            |
| activations     | A m                    | A m                            | A m        | A m                  |
| gathered        | 0                      | 0                              | 0          | c max(U, min(2U, L)) |
| buffers         | 0                      | 0                              | r B        | r B                  |

c = compute-dtype size (4 fp32, 2 bf16/fp16), a = gradient-accumulation dtype size (4), s = states per
element (Adam/AdamW 2, Adagrad/Lion/SGD-with-momentum 1), r = communication-dtype size (the compute
dtype's unless ``communication_precision`` says otherwise).

- **activations**: ``activation_bytes_per_sample`` (A: the bytes autograd saves for backward per sample,
  measured in one forward) times ``micro_batch_size`` (m). With activation checkpointing, pass the
  checkpointed model's bytes.
- **gathered** (stage 3): the fetch unit in use, gathered whole, and the next one prefetched: twice the
  largest unit (U = ``largest_unit_numel`` elements), bounded by ``stage3_max_live_parameters``
  (L = ``max_live_numel``; None: no bound beyond the two units) but never below one unit.
- **buffers** (stages 2 and 3): the gradient staging buckets in flight, at most ``reduce_bucket_size``
  elements (B = ``bucket_numel``) in the communication dtype. Stages 0 and 1 reduce their flat gradient
  buffer in place: nothing extra.
- **offload**: with optimizer offload the fp32 masters and the optimizer state live in host memory
  (``offloaded``); fp32 masters are separate copies then, except when the compute device is the CPU
  itself. A partial offload (``offload_ratio`` r < 1, ``offload_optimizer.ratio``) keeps r of them there
  and 1 - r on the device (the engine's split falls on bucket boundaries, at least r on the host:
  runtime/zero/partial_offload.py). With ``offload_param`` (stage 3) the compute-dtype parameter shards
  live there too (``offloaded_params``). ``peak_on_device`` leaves both out; ``peak`` counts them (on a
  CPU-only run host memory is the device's).

Not counted: bucket padding (< W x 16 elements per bucket), stage 3's persistent parameters (small ones
kept whole on every rank), the input batch, and the framework's own allocations (CUDA context, kernels,
the allocator's caching).

DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs`` ... ``_all_live``) keep their names and
signatures and print the same "per CPU | per GPU | options" table, computed by this model for the mixed
precision (bf16) and Adam they assume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..table import print_table
from .zero.units import policy_of, unit_owners

_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2}
_STATES = {"adam": 2, "adamw": 2, "adagrad": 1, "lion": 1, "sgd": 1}
_GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes: the model states (``total``) and the transient terms of a step (``peak``)."""

    params: int
    grads: int
    master: int
    optimizer_state: int
    offloaded: int  # of master + optimizer_state, the bytes kept in host memory
    activations: int = 0
    gathered: int = 0
    buffers: int = 0
    offloaded_params: int = 0  # of params, the bytes kept in host memory (stage 3 parameter offload)
    offload_ratio: float = 1.0  # of master + optimizer_state, the share in ``offloaded`` (when offloading)

    @property
    def total(self) -> int:
        """The model states: params + grads + master + optimizer state."""
        return self.params + self.grads + self.master + self.optimizer_state

    @property
    def on_device(self) -> int:
        """The model states outside host memory."""
        return self.total - self.offloaded - self.offloaded_params

    @property
    def peak(self) -> int:
        """The model states plus the transient terms of a step: its activations, the gathered stage-3 units
        and the gradient buckets in flight."""
        return self.total + self.activations + self.gathered + self.buffers

    @property
    def peak_on_device(self) -> int:
        """``peak`` less what lives in host memory (offloaded masters, optimizer state, parameter shards):
        what a GPU must fit."""
        transient = self.peak - self.total
        return self.on_device + transient

    def as_dict(self, *, by_device: bool = False) -> dict[str, int]:
        """The model states by category, as ``engine.memory_breakdown()`` names them; ``by_device``: each cut
        into the device's part and the host's (``<kind>_host``), as ``engine.memory_breakdown(by_device=True)``."""
        out = {
            "params": self.params,
            "grads": self.grads,
            "master": self.master,
            "optimizer_state": self.optimizer_state,
        }
        if not by_device:
            return out
        master_host = round(self.master * self.offload_ratio) if self.offloaded else 0
        host = {
            "params": self.offloaded_params,
            "grads": 0,
            "master": master_host,
            "optimizer_state": self.offloaded - master_host,
        }
        return {k: v for key, total in out.items() for k, v in ((key, total - host[key]), (f"{key}_host", host[key]))}


def estimate_memory(
    model_or_num_params: nn.Module | int,
    world_size: int = 1,
    stage: int = 0,
    offload: bool = False,
    precision: str = "fp32",
    *,
    optimizer: str = "Adam",
    device: str = "cuda",
    offload_param: bool = False,
    activation_bytes_per_sample: int = 0,
    micro_batch_size: int = 1,
    largest_unit_numel: int = 0,
    max_live_numel: int | None = None,
    bucket_numel: int = 0,
    communication_precision: str | None = None,
    offload_ratio: float = 1.0,
) -> MemoryEstimate:
    """Per-rank bytes of the model states and a step's transient terms (see the table above).

    ``model_or_num_params``: a module (its trainable parameters are counted) or a parameter count.
    ``precision``: "fp32", "bf16" or "fp16". ``device``: the compute device kind ("cuda" or "cpu"; with
    "cpu", offloaded fp32 masters need no separate copy). ``offload``: optimizer offload (stages 1-3);
    ``offload_param``: parameter offload (stage 3). ``activation_bytes_per_sample`` x ``micro_batch_size``:
    the activations; ``largest_unit_numel`` / ``max_live_numel``: stage 3's gathered units;
    ``bucket_numel``: ``reduce_bucket_size`` (stages 2-3) in ``communication_precision`` (default: the
    compute precision). ``offload_ratio``: with ``offload``, the share of masters and optimizer state in host
    memory (``offload_optimizer.ratio``; the rest counts on the device).
    """
    if isinstance(model_or_num_params, nn.Module):
        n = sum(p.numel() for p in model_or_num_params.parameters() if p.requires_grad)
    else:
        n = int(model_or_num_params)
    comm = precision if communication_precision is None else communication_precision
    for value in (precision, comm):
        if value not in _SIZES:
            raise ValueError(f"precision must be one of {', '.join(_SIZES)}, got {value!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if offload and stage == 0:
        raise ValueError(
            "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps the optimizer state on every rank)"
        )
    if offload_param and stage != 3:
        raise ValueError(f"parameter offload needs ZeRO stage 3, got stage {stage}")
    if not 0.0 < offload_ratio <= 1.0:
        raise ValueError(f"offload_ratio must be in (0, 1] (offload_optimizer.ratio), got {offload_ratio}")
    states = _STATES.get(optimizer.lower())
    if states is None:
        raise ValueError(f"optimizer must be one of {', '.join(_STATES)}, got {optimizer!r}")
    sizes = (activation_bytes_per_sample, largest_unit_numel, bucket_numel, max_live_numel or 0)
    if min(sizes) < 0 or micro_batch_size < 1:
        raise ValueError(
            "activation_bytes_per_sample, largest_unit_numel, max_live_numel and bucket_numel must be >= 0 and "
            f"micro_batch_size >= 1, got {sizes[:3]}, {max_live_numel} and {micro_batch_size}"
        )
    c = _SIZES[precision]
    share = n if stage == 0 else n // world_size
    params = c * share if stage == 3 else c * n
    grads = {0: 4 * n, 1: 4 * n + 4 * share, 2: 4 * share, 3: 4 * share}[stage]
    in_place = precision == "fp32" and (not offload or device == "cpu")
    master = 0 if in_place else 4 * share
    optimizer_state = 4 * states * share
    offloaded = round(offload_ratio * (master + optimizer_state)) if offload else 0
    gathered = 0
    if stage == 3:
        live = 2 * largest_unit_numel if max_live_numel is None else min(2 * largest_unit_numel, max_live_numel)
        gathered = c * max(largest_unit_numel, live)
    return MemoryEstimate(
        params,
        grads,
        master,
        optimizer_state,
        offloaded,
        activations=activation_bytes_per_sample * micro_batch_size,
        gathered=gathered,
        buffers=_SIZES[comm] * bucket_numel if stage >= 2 else 0,
        offloaded_params=params if offload_param else 0,
        offload_ratio=offload_ratio if offload else 1.0,
    )


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed's estimators: the same names, arguments and table, computed by the model above.

Row = tuple[int, int, str]  # (per CPU bytes, per GPU bytes, options)


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(host bytes per node, device bytes per rank) of ZeRO stage 2's model states, bf16 with Adam.

    Per GPU: ``estimate_memory(..., stage=2).on_device``. Per CPU: the node's ranks each build the fp32
    model on the host first (4 bytes per parameter), and with ``cpu_offload`` keep their masters and Adam
    state there; ``additional_buffer_factor`` pads the host side as DeepSpeed's does.
    """
    ranks = num_gpus_per_node * num_nodes
    est = estimate_memory(total_params, ranks, 2, cpu_offload, "bf16")
    host = max(4 * total_params, est.offloaded) * num_gpus_per_node
    return int(host * additional_buffer_factor), est.on_device


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(host bytes per node, device bytes per rank, bytes of the largest layer gathered) of ZeRO stage 3's
    model states, bf16 with Adam.

    Per GPU: ``estimate_memory(..., stage=3, offload_param=cpu_offload_params)``'s ``peak_on_device`` with
    the largest layer gathered (and the next prefetched). Per CPU: what the node's ranks offload, or the
    model they build on the host first: whole in fp32 on every rank without ``zero_init``, one layer at a
    time with it (``ds_strategy.zero.Init`` partitions each as it is built).
    """
    ranks = num_gpus_per_node * num_nodes
    est = estimate_memory(
        total_params,
        ranks,
        3,
        cpu_offload,
        "bf16",
        offload_param=cpu_offload_params,
        largest_unit_numel=largest_layer_params,
    )
    built = 4 * (largest_layer_params if zero_init else total_params)
    host = max(built, est.offloaded + est.offloaded_params) * num_gpus_per_node
    return int(host * additional_buffer_factor), est.peak_on_device, est.gathered


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[Row]:
    """Print and return stage 2's needs for ``model`` with and without optimizer offload:
    ``[(per CPU bytes, per GPU bytes, options), ...]``."""
    total = _trainable(model)
    rows: list[Row] = []
    for offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node, num_nodes, offload, additional_buffer_factor
        )
        rows.append((cpu, gpu, f"offload_optimizer={'cpu' if offload else 'none'}"))
    _print_needs(2, num_gpus_per_node, num_nodes, f"{total / 1e6:.0f}M total params", rows)
    return rows


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[Row]:
    """Print and return stage 3's needs for ``model``, one row per offload choice and ``zero_init``:
    ``[(per CPU bytes, per GPU bytes, options), ...]``. The largest layer is the largest stage-3 fetch unit
    of ``model`` (a repeated block under the default ``"blocks"`` units)."""
    total, largest = _trainable(model), largest_fetch_unit(model)
    rows: list[Row] = []
    for offload_param, offload_optimizer in ((True, True), (False, True), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total,
                largest,
                num_gpus_per_node,
                num_nodes,
                offload_optimizer,
                offload_param,
                zero_init,
                additional_buffer_factor,
            )
            options = (
                f"offload_param={'cpu' if offload_param else 'none'}, "
                f"offload_optimizer={'cpu' if offload_optimizer else 'none'}, zero_init={int(zero_init)}"
            )
            rows.append((cpu, gpu, options))
    sw = f"{total / 1e6:.0f}M total params, {largest / 1e6:.0f}M largest layer params"
    _print_needs(3, num_gpus_per_node, num_nodes, sw, rows)
    return rows


def largest_fetch_unit(model: nn.Module) -> int:
    """Trainable elements of ``model``'s largest stage-3 fetch unit under its fetch-unit policy (a repeated
    block, or the rest of the model when that is larger): what stage 3 gathers whole."""
    sizes: dict[int, int] = {}
    owners = unit_owners(model, policy_of(model, None))
    for module in model.modules():
        unit = id(owners.get(id(module), model))
        direct = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        sizes[unit] = sizes.get(unit, 0) + direct
    return max(sizes.values(), default=0)


def saved_activation_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes autograd saves for backward while ``forward()`` runs: the unique storages its saved tensors
    use, ``model``'s parameters excluded (they are model states). Divided by the batch size, this is
    ``estimate_memory``'s ``activation_bytes_per_sample``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _print_needs(stage: int, gpus: int, nodes: int, software: str, rows: Sequence[Row]) -> None:
    title = (
        f"Estimated memory needed for params, optim states and gradients (ZeRO stage {stage}, bf16, Adam): "
        f"{nodes} node(s), {gpus} GPU(s) per node; model with {software}"
    )
    cells = [(f"{cpu / _GIB:.2f}GB", f"{gpu / _GIB:.2f}GB", options) for cpu, gpu, options in rows]
    print_table(title, ("per CPU", "per GPU", "options"), cells)
