"""``PipelineModule``: a model written as a list of layers, cut into pipeline stages (DeepSpeed's API).

    layers = [LayerSpec(nn.Linear, 16, 32), nn.ReLU(), LayerSpec(nn.Linear, 32, 4)]
    model = PipelineModule(layers, num_stages=2, loss_fn=nn.MSELoss())

Each rank builds only the layers of its own stage (a ``LayerSpec`` is a recipe, built where it is owned;
``"parameters"`` partitioning counts parameters on the meta device, so nothing is allocated elsewhere).
A ``TiedLayerSpec`` with the same ``key`` on several stages (embedding and output head) is one module per
stage whose ``tied_weight_attr`` tensors are broadcast from the first owning stage at construction and
whose gradients are summed across the tie group before every optimizer step (by the PipelineEngine).

Parameter names are those of a one-stage model: layer ``i``'s parameters are ``"{i}.<name>"``, a tied
module's ``"tied_modules.<key>.<name>"``; checkpoints and the consolidated state dict use them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_strategy.accelerator import get_accelerator
from ds_strategy.comm import GroupSet, init_distributed

from ..activation_checkpointing import checkpoint as _default_checkpoint
from .partition import partition_balanced, partition_uniform, type_weights
from .topology import PipeDataParallelTopology, ProcessTopology


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``LayerSpec(nn.Linear, 16, 32, bias=False)``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` tensors are shared by every layer of the same ``key``, on any
    stage; ``forward_fn(module, x)`` replaces ``module(x)`` where given (e.g. an embedding used as head)."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_numel(layer: Any) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # counted without allocating
            built = layer.build()
        return sum(p.numel() for p in built.parameters() if p.requires_grad)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def partition_layers(layers: Sequence[Any], num_stages: int, method: str) -> list[int]:
    """Stage boundaries of ``layers`` for ``partition_method`` (see ``partition.py``)."""
    low = method.lower()
    if low == "uniform":
        return partition_uniform(len(layers), num_stages)
    if low == "parameters":
        return partition_balanced([_trainable_numel(layer) for layer in layers], num_stages)
    if low.startswith("type:"):
        return partition_balanced(type_weights([_layer_name(x) for x in layers], method.split(":", 1)[1]), num_stages)
    raise ValueError(f"partition_method {method!r} is not supported; valid: 'parameters', 'uniform', 'type:<regex>'")


def _comm_device(t: torch.Tensor) -> torch.device:
    """Where a collective on ``t``'s values runs: its own device if an accelerator's, else the device the
    engine will train on (the current CUDA device, or the CPU accelerator's: ``cpu:0`` under the
    device-strict mode)."""
    if t.device.type != "cpu":
        return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return get_accelerator("cpu").device()


def _recursive_getattr(module: nn.Module, name: str) -> Any:
    out: Any = module
    for part in name.split("."):
        out = getattr(out, part)
    return out


class PipelineModule(nn.Module):
    """The local stage of a pipelined model (see the module docstring for the arguments' meaning).

    ``topology`` (a ``ProcessTopology`` with a ``pipe`` axis) or ``num_stages`` (then the data-parallel
    degree is world size / num_stages) fixes the grid; ``partition_method`` is ``"parameters"`` (default),
    ``"uniform"`` or ``"type:<regex>"``. ``seed_layers`` seeds ``seed_fn`` (default ``torch.manual_seed``)
    with ``base_seed + layer index`` before building each layer, so every depth builds the same weights.
    ``activation_checkpoint_interval`` > 0 checkpoints runs of that many layers with
    ``activation_checkpoint_func``, those holding parameters or, given ``checkpointable_layers`` (class
    names), those holding such a layer.
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = _default_checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule needs num_stages= or topology=")
        if not dist.is_initialized():
            init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        if topology is None:
            assert num_stages is not None
            if num_stages < 1 or world % num_stages:
                raise ValueError(
                    f"num_stages={num_stages} must divide the world size {world} (valid: "
                    f"{[d for d in range(1, world + 1) if world % d == 0]})"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        if "pipe" not in topology.get_axis_names():
            raise ValueError(f"topology needs a 'pipe' axis, has {topology.get_axis_names()}")
        if topology.world_size() != world:
            raise ValueError(f"topology covers {topology.world_size()} ranks but the world size is {world}")
        if num_stages is not None and num_stages != topology.get_dim("pipe"):
            raise ValueError(
                f"num_stages={num_stages} disagrees with the topology's pipe dim {topology.get_dim('pipe')}"
            )
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        others = {a: topology.get_dim(a) for a in topology.get_axis_names() if a not in ("pipe", "data")}
        if any(d > 1 for d in others.values()):
            # Accepted (layers may split themselves over these groups, Megatron-style), never silently.
            warnings.warn(
                f"PipelineModule: the topology's {others} axes get no parallelism from ds_strategy: each of "
                "those ranks builds and runs its whole stage (duplicated work, gradients not reduced across "
                "them) unless the layers split themselves over topology().get_axis_comm_lists(axis)",
                UserWarning,
                stacklevel=2,
            )
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        self.global_rank = rank
        coord = topology.get_coord(rank)
        self.stage_id: int = int(coord.pipe)
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers is not None else None
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self.partition_method = partition_method
        self.parts = partition_layers(self._layer_specs, self.num_stages, partition_method)
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self._groups = _Groups(topology, rank)
        self.forward_funcs: list[Callable[..., Any]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.micro_offset = 0
        self._build()
        self.tied_comms = self._tie_groups()
        self._synchronize_tied_weights()

    # ------------------------------------------------------------------ construction
    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise TypeError(f"layer {idx}: a PipelineModule cannot be nested in another")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                tied = self.tied_modules[layer.key]
                self.forward_funcs.append(tied if layer.forward_fn is None else partial(layer.forward_fn, tied))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(idx), module)
                self.forward_funcs.append(module)
            elif isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
            elif callable(layer):
                self.forward_funcs.append(layer)
            else:
                raise TypeError(f"layer {idx} is {type(layer).__name__}: give an nn.Module, a LayerSpec or a callable")

    def tied_stages(self) -> dict[str, list[int]]:
        """Every tie key and the stages holding it (the same on every rank)."""
        out: dict[str, list[int]] = {}
        for s in range(self.num_stages):
            for layer in self._layer_specs[self.parts[s] : self.parts[s + 1]]:
                if isinstance(layer, TiedLayerSpec) and s not in out.setdefault(layer.key, []):
                    out[layer.key].append(s)
        return out

    def _tie_groups(self) -> dict[str, dict[str, Any]]:
        """One process group per tie key and per position on the other axes; every rank creates all of
        them in the same order (``new_group`` is collective)."""
        comms: dict[str, dict[str, Any]] = {}
        self._tie_owned = GroupSet(self, attributes=("tied_comms",))  # destroyed at exit (comm/ownership.py)
        topo = self._topo
        others = [a for a in topo.get_axis_names() if a != "pipe"]
        for key, stages in sorted(self.tied_stages().items()):
            if len(stages) < 2:
                continue
            for ranks in topo.get_axis_comm_lists("pipe"):
                tie_ranks = sorted(r for r in ranks if int(topo.get_coord(r).pipe) in stages)
                group = self._tie_owned.new_group(ranks=tie_ranks)
                if self.global_rank in tie_ranks and key in self.tied_modules:
                    comms[key] = {"ranks": tie_ranks, "group": group, "weight_attr": self.tied_weight_attrs[key]}
        del others
        return comms

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        module = self.tied_modules[key]
        return [_recursive_getattr(module, attr) for attr in self.tied_weight_attrs[key]]

    @torch.no_grad()
    def _synchronize_tied_weights(self) -> None:
        """Broadcast the tied tensors from the first owning stage; through a device copy when the layers
        were built on the host (NCCL takes device tensors only)."""
        for key, comm in self.tied_comms.items():
            for p in self.tied_parameters(key):
                moved = p.data.to(_comm_device(p.data))
                dist.broadcast(moved, src=min(comm["ranks"]), group=comm["group"])
                if moved is not p.data:
                    p.data.copy_(moved)

    # ------------------------------------------------------------------ forward
    def _is_checkpointable(self, funcs: Sequence[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return any(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def forward(self, forward_input: Any) -> Any:
        self.micro_offset += 1
        offset = self.micro_offset + 1

        def exec_range(start: int, end: int) -> Callable[..., Any]:
            def run(*inputs: Any) -> Any:
                x: Any = inputs[0] if len(inputs) == 1 else inputs
                for i, layer in enumerate(self.forward_funcs[start:end]):
                    if self.seed_layers:
                        (self.seed_fn or torch.manual_seed)(self.base_seed * offset + self._local_start + start + i)
                    x = layer(x)
                return x

            return run

        n = len(self.forward_funcs)
        if self.activation_checkpoint_interval == 0 or not self.training:
            return exec_range(0, n)(forward_input)
        x = forward_input
        for start in range(0, n, self.activation_checkpoint_interval):
            end = min(start + self.activation_checkpoint_interval, n)
            args = x if isinstance(x, tuple) else (x,)
            if self._is_checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(exec_range(start, end), *args)
            else:
                x = exec_range(start, end)(*args)
        return x

    # ------------------------------------------------------------------ DeepSpeed's accessors
    def topology(self) -> ProcessTopology:
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer index {layer_idx} out of range 0..{self._num_layers - 1}")
        for s in range(self.num_stages):
            if self.parts[s] <= layer_idx < self.parts[s + 1]:
                return s
        raise AssertionError("unreachable")

    @property
    def local_layers(self) -> range:
        return range(self._local_start, self._local_stop)

    @property
    def groups(self) -> _Groups:
        return self._groups


class _Groups:
    """The process groups of a topology: this rank's data-parallel group and its pipeline (stage list)."""

    def __init__(self, topo: ProcessTopology, rank: int) -> None:
        self.data_group: dist.ProcessGroup | None = None
        self.pipe_group: dist.ProcessGroup | None = None
        self.pipe_ranks: list[int] = [rank]
        self.data_ranks: list[int] = [rank]
        self.owned = GroupSet(self, attributes=("data_group", "pipe_group"))  # destroyed at exit
        world = topo.world_size()
        for axis in ("data", "pipe"):
            for ranks in topo.get_axis_comm_lists(axis) or [[r] for r in range(world)]:
                group = self.owned.new_group(ranks=ranks) if world > 1 else None
                if rank in ranks:
                    if axis == "data":
                        self.data_group, self.data_ranks = group, ranks
                    else:
                        self.pipe_group, self.pipe_ranks = group, ranks
