"""Tensor-parallel generation for the hybrid engine (``hybrid_engine.inference_tp_size``).

    tp = build_tensor_parallel(model, size=2, coll=comm)  # None for size 1; collective (creates the groups)
    out = tp.generate(fn, args, kwargs)   # every rank of the group gets its own prompts' rows
    tp_plan(model)                        # the plan it follows: {"layers.*.self_attn.q_proj": "colwise", ...}

[Note: tensor-parallel generation]
A decoding step reads every weight once for a handful of rows: it is bound by memory bandwidth (on a GPU
also by kernel launches), not by arithmetic. With ``inference_tp_size`` = t, the t ranks of a group
concatenate their prompts (every tensor argument, along dim 0: the shapes must agree), generate the joint
batch together, each reading only 1/t of every planned weight, and each keeps its own rows of the output.
The plan says how each ``nn.Linear`` is split, Megatron-style: ``colwise`` layers keep 1/t of the output
features (their heads), ``rowwise`` layers read those features and keep 1/t of the input features; the
partial sums are all-gathered and added in rank order (so every rank holds bit-identical activations and
takes the same decisions: greedy tokens, stopping), the bias added by the group's first rank only.
Packed projections split each block alike: ``packed_qkv_colwise`` a fused [q; k; v]
(``nn.MultiheadAttention``'s ``in_proj_weight``, or a Linear), Hugging Face's ``packed_colwise`` a fused
[gate; up]. The slices are views of the full weights (stage 3: of the hybrid engine's gathered copy),
swapped into ``param.data`` for the call and restored after; only packed projections are copied. Sampling
draws from one seed per call, broadcast from the group's first rank, in a forked RNG state, so the ranks
sample alike.

Where the plan comes from: the module's ``tp_plan`` attribute (ds_strategy's demo GPT has one), or a
Hugging Face model's ``config.base_model_tp_plan`` (Llama, Mistral, Qwen2, ... ship one; its names are
prefixed with ``base_model_prefix``). Styles that keep a layer whole (``replicate``, ``embedding_rowwise``,
...: WHOLE below) leave it unsplit; any other style is refused. The model's generation path must derive
head counts from the weights it gets (Hugging Face attention reshapes with ``-1`` heads), which is why the
attention-head counts must divide by t.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_strategy.comm.collectives import Communicator
from ds_strategy.comm.ownership import GroupSet
from ds_strategy.config.errors import ConfigError, ConfigProblem

# Packed projections: how many blocks one weight stacks (each split alike): Hugging Face's packed_colwise is
# [gate; up], ours packed_qkv_colwise is [q; k; v] (nn.MultiheadAttention's in_proj_weight).
PACKED = {"packed_colwise": 2, "packed_qkv_colwise": 3}
# rowwise_split_input: a rowwise layer whose input arrives whole (after a layer kept whole): it reads its share.
SPLIT = ("colwise", "rowwise", "rowwise_split_input", *PACKED)
# Styles whose layers stay whole here (replicated: the same result, without the saving).
WHOLE = (
    "replicate",
    "replicated_with_grad_allreduce",
    "colwise_gather_output",
    "colwise_rep",
    "gather",
    "embedding_rowwise",
)
_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


class TensorParallelPlanError(ValueError):
    """The model cannot be generated tensor-parallel as asked (no plan, a style or shape that does not split)."""


def tp_plan(module: nn.Module) -> dict[str, str]:
    """The module's tensor-parallel plan (pattern -> style), or {} when it has none (see the module notes).
    A module without one of its own (a LightningModule, a wrapper) takes its submodules' plans, prefixed with
    their names."""
    own = _own_plan(module)
    if own:
        return own
    return {
        f"{name}.{glob}": style for name, child in module.named_children() for glob, style in tp_plan(child).items()
    }


def _own_plan(module: nn.Module) -> dict[str, str]:
    own = getattr(module, "tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    config = getattr(module, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base, Mapping) or not base:
        return {}
    prefix = getattr(module, "base_model_prefix", "")
    inner = getattr(module, prefix, None) if prefix else None
    lead = f"{prefix}." if isinstance(inner, nn.Module) and inner is not module else ""
    return {lead + pattern: style for pattern, style in base.items()}


def _pattern(glob: str) -> re.Pattern[str]:
    """``layers.*.mlp.up_proj``: ``*`` stands for one name component."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in glob.split(".")))


@dataclass
class PlannedLayer:
    name: str
    module: nn.Module
    style: str


KEY = "hybrid_engine.inference_tp_size"


def build_tensor_parallel(module: nn.Module, *, size: int, coll: Communicator) -> TensorParallelGeneration | None:
    """Tensor-parallel generation over groups of ``size`` consecutive ranks of ``coll``'s group, or None for
    size 1. A collective call over that group (it creates the groups); a ConfigError naming
    ``hybrid_engine.inference_tp_size`` when the size or the model does not allow it."""
    if size <= 1:
        return None
    world = coll.world_size
    if world % size:
        raise ConfigError(
            [ConfigProblem(KEY, f"{size} does not divide the {world} ranks; choose a divisor of {world}")]
        )
    plan = tp_plan(module)
    if not plan:
        raise ConfigError([ConfigProblem(KEY, (
            f"{size} asks for tensor-parallel generation, but {type(module).__name__} has no tensor-parallel plan "
            "(a tp_plan attribute, or a Hugging Face config.base_model_tp_plan); set it to 1 or give the model one "
            "(docs/hybrid_engine.md)"))])  # fmt: skip
    try:
        splits = plan_splits(module, plan, size)
    except TensorParallelPlanError as err:
        raise ConfigError([ConfigProblem(KEY, str(err))]) from None
    if size == world:
        return TensorParallelGeneration(splits, Communicator(coll.group, worker_from=coll))
    ranks = dist.get_process_group_ranks(coll.group) if coll.group is not None else list(range(world))
    mine = None
    owned = GroupSet()  # the generation's groups: destroyed by its close() and at exit
    for start in range(0, world, size):  # every rank creates every group, in the same order
        group = owned.new_group(ranks[start : start + size])
        if start <= coll.rank < start + size:
            mine = group
    generation = TensorParallelGeneration(splits, Communicator(mine, worker_from=coll))
    owned.bind(generation)
    generation.owned = owned
    return generation


def plan_splits(module: nn.Module, plan: Mapping[str, str], size: int) -> list[PlannedLayer]:
    """The module's layers the plan splits, checked (TensorParallelPlanError: a style, module or shape that
    does not split ``size`` ways)."""
    return _Planner(size).resolve(module, plan)


class _Planner:
    def __init__(self, size: int) -> None:
        self.size = size

    def resolve(self, module: nn.Module, plan: Mapping[str, str]) -> list[PlannedLayer]:
        where = f"{type(module).__name__}'s tensor-parallel plan"
        bad = sorted({s for s in plan.values() if s not in SPLIT + WHOLE})
        if bad:
            raise TensorParallelPlanError(
                f"{where} uses {bad}; generation splits only {list(SPLIT)} (and keeps {list(WHOLE)} whole): set it to 1"
            )
        self._check_heads(module)
        patterns = [(_pattern(glob), style) for glob, style in plan.items() if style in SPLIT]
        splits = []
        for name, sub in module.named_modules():
            style = next((s for p, s in patterns if p.fullmatch(name)), None)
            if style is not None:
                self._check_shape(name, sub, style)
                splits.append(PlannedLayer(name, sub, style))
        if not splits:
            raise TensorParallelPlanError(
                f"{where} ({dict(plan)}) names no module of the model; set it to 1 or give the model a tp_plan "
                "matching its module names"
            )
        return splits

    def _check_heads(self, module: nn.Module) -> None:
        """Every (Hugging Face) config in the module tree, the model's own or one inside a wrapper."""
        configs = {id(c): c for sub in module.modules() if (c := getattr(sub, "config", None)) is not None}
        for config in configs.values():
            for key in _HEAD_KEYS:
                heads = getattr(config, key, None)
                if isinstance(heads, int) and heads % self.size:
                    raise TensorParallelPlanError(
                        f"is {self.size} but the model's {key} is {heads}: each rank needs whole heads; choose a "
                        f"size that divides {heads}"
                    )

    def _check_shape(self, name: str, sub: nn.Module, style: str) -> None:
        weight = _weight(sub, style)  # its data may be a stage-3 placeholder: the shape comes from the module
        if weight is None:
            raise TensorParallelPlanError(
                f"the plan's entry {name!r} ({style}) is a {type(sub).__name__}; only nn.Linear layers (and "
                "nn.MultiheadAttention's packed projection) split"
            )
        rows, cols = _full_shape(sub)
        blocks = PACKED.get(style, 1)
        rowwise = style.startswith("rowwise")
        extent = cols if rowwise else (rows // blocks if rows % blocks == 0 else -1)
        if extent <= 0 or extent % self.size:
            dim = "input" if rowwise else "output"
            raise TensorParallelPlanError(
                f"is {self.size} but {name!r} ({style}) has {extent} {dim} "
                f"features{' per packed block' if blocks > 1 else ''}, not divisible by it"
            )


class TensorParallelGeneration:
    """Runs a generate function tensor-parallel over ``comm``'s group (see [Note: tensor-parallel generation])."""

    def __init__(self, splits: list[PlannedLayer], comm: Communicator) -> None:
        self.splits = splits
        self.comm = comm
        self.size = comm.world_size
        self.rank = comm.rank
        self.owned: GroupSet | None = None  # the group below when this generation created it

    def close(self) -> None:
        self.comm.close()
        if self.owned is not None:
            self.owned.destroy()

    # ------------------------------------------------------------------ one call
    def generate(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn`` on the group's joint batch; this rank's rows of the result."""
        batch, device = self._check_batches(args, kwargs)
        joint_args = tuple(self._joined(a) for a in args)
        joint_kwargs = {k: self._joined(v) for k, v in kwargs.items()}
        try:
            with self._one_seed(device), self.split():
                out = fn(*joint_args, **joint_kwargs)
        except RuntimeError as err:  # most likely a shape error: say where it comes from
            err.add_note(
                f"(raised during tensor-parallel generation, hybrid_engine.inference_tp_size={self.size}: each rank "
                "held a share of the heads and features of the layers the model's plan splits; a model whose "
                "forward counts heads from its config instead of its weights cannot generate this way: set "
                "inference_tp_size to 1)"
            )
            raise
        return _rows(out, self.rank * batch, batch, batch * self.size)

    def _check_batches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, torch.device]:
        """This rank's batch size and the prompts' device (where the call's small collectives go)."""
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors or tensors[0].dim() == 0:
            raise TypeError(
                "engine.generate() with hybrid_engine.inference_tp_size > 1 needs the prompts as a tensor argument "
                "with the batch in dim 0 (the group's ranks generate their prompts together)"
            )
        # On the prompts' device: an NCCL group moves no CPU tensors.
        device = tensors[0].device
        shapes = torch.tensor([d for t in tensors for d in (t.dim(), *t.shape)], dtype=torch.int64, device=device)
        sizes = torch.tensor([shapes.numel()], dtype=torch.int64, device=device)
        all_sizes = torch.empty(self.size, dtype=torch.int64, device=device)
        self.comm.all_gather_into_tensor(all_sizes, sizes)
        same = bool((all_sizes == sizes).all())
        if same:
            every = torch.empty(self.size * shapes.numel(), dtype=torch.int64, device=device)
            self.comm.all_gather_into_tensor(every, shapes)
            same = bool((every.view(self.size, -1) == shapes).all())
        if not same:  # every rank of the group sees the same gathered shapes: all raise together
            raise ValueError(
                "engine.generate() with hybrid_engine.inference_tp_size > 1: the ranks of a tensor-parallel group "
                "passed tensors of different shapes; pad the prompts to one length and batch size on every rank"
            )
        return int(tensors[0].shape[0]), device

    def _joined(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        src = value.contiguous() if value.dtype != torch.bool else value.to(torch.uint8)  # gloo has no bool
        out = src.new_empty((src.shape[0] * self.size, *src.shape[1:]))
        self.comm.all_gather_into_tensor(out, src)
        return out.bool() if value.dtype == torch.bool else out

    @contextlib.contextmanager
    def _one_seed(self, device: torch.device) -> Iterator[None]:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)  # advances each rank's stream by one draw
        seed = seed.to(device)
        self.comm.broadcast(seed, src=0)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(int(seed.item()))
            yield

    @contextlib.contextmanager
    def split(self) -> Iterator[None]:
        """Every planned layer sliced to this rank's share (and rowwise layers reducing) until exit."""
        saved: list[tuple[nn.Parameter, torch.Tensor]] = []
        hooks = []
        try:
            with torch.no_grad():
                for s in self.splits:
                    saved += self._slice(s)
                    if s.style.startswith("rowwise"):
                        hooks.append(s.module.register_forward_hook(self._reduce))
                    if s.style == "rowwise_split_input":
                        hooks.append(s.module.register_forward_pre_hook(self._own_share))
            yield
        finally:
            for h in hooks:
                h.remove()
            for p, data in saved:
                p.data = data

    def _slice(self, s: PlannedLayer) -> list[tuple[nn.Parameter, torch.Tensor]]:
        weight = _weight(s.module, s.style)
        bias = _bias(s.module, s.style)
        assert weight is not None
        saved = [(weight, weight.data)] + ([(bias, bias.data)] if bias is not None else [])
        rows, cols = weight.shape
        r, n = self.rank, self.size
        if s.style == "colwise":
            weight.data = weight.data[r * rows // n : (r + 1) * rows // n]
            if bias is not None:
                bias.data = bias.data[r * rows // n : (r + 1) * rows // n]
        elif s.style.startswith("rowwise"):
            weight.data = weight.data[:, r * cols // n : (r + 1) * cols // n]
            if bias is not None and r != 0:  # the partial sums are added: the bias once, by the first rank
                bias.data = torch.zeros_like(bias.data)
        else:  # packed: this rank's share of each block (a copy)
            blocks = PACKED[s.style]
            block = rows // blocks
            take = [torch.arange(k * block + r * block // n, k * block + (r + 1) * block // n) for k in range(blocks)]
            index = torch.cat(take).to(weight.device)
            weight.data = weight.data.index_select(0, index)
            if bias is not None:
                bias.data = bias.data.index_select(0, index)
        return saved

    def _own_share(self, _module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """rowwise_split_input: this rank's columns of the whole input."""
        x, *rest = inputs
        width = x.shape[-1] // self.size
        return (x[..., self.rank * width : (self.rank + 1) * width], *rest)

    def _reduce(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        """A rowwise layer's partial sums, all-gathered and added in rank order (bit-identical on every rank)."""
        part = output.contiguous()
        every = part.new_empty((self.size, *part.shape))
        self.comm.all_gather_into_tensor(every.view(-1), part.view(-1))
        total = every[0].clone()
        for k in range(1, self.size):
            total += every[k]
        return total


def _weight(module: nn.Module, style: str) -> nn.Parameter | None:
    if style in PACKED and isinstance(module, nn.MultiheadAttention):
        return module.in_proj_weight
    weight = getattr(module, "weight", None)
    return weight if isinstance(weight, nn.Parameter) and isinstance(module, nn.Linear) else None


def _bias(module: nn.Module, style: str) -> nn.Parameter | None:
    if style in PACKED and isinstance(module, nn.MultiheadAttention):
        return module.in_proj_bias
    return getattr(module, "bias", None)


def _full_shape(module: nn.Module) -> tuple[int, int]:
    """(out, in) features of a Linear, or of a MultiheadAttention's packed projection."""
    if isinstance(module, nn.MultiheadAttention):
        return 3 * module.embed_dim, module.embed_dim
    assert isinstance(module, nn.Linear)
    return module.out_features, module.in_features


def _rows(out: Any, start: int, count: int, joint: int) -> Any:
    """This rank's rows of every tensor in ``out`` whose dim 0 is the joint batch (tensors, tuples, dicts,
    Hugging Face ``ModelOutput``s); anything else unchanged."""
    if isinstance(out, torch.Tensor):
        return out[start : start + count] if out.dim() and out.shape[0] == joint else out
    if isinstance(out, Mapping):
        picked = {k: _rows(v, start, count, joint) for k, v in out.items()}
        try:
            return type(out)(**picked)
        except TypeError:
            return picked
    if isinstance(out, tuple):
        items = [_rows(v, start, count, joint) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    if isinstance(out, list):
        return [_rows(v, start, count, joint) for v in out]
    return out
