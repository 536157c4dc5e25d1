"""The tensors a per-tensor optimizer steps: this rank's whole parameters, shaped, inside its masters.

[Note: per-tensor optimizers under ZeRO]
Muon orthogonalises each weight matrix, Adafactor factors each parameter's second moment into row and
column statistics: their step is a function of the whole tensor and its shape, so stepping a flat
fragment of a bucket (what elementwise optimizers get, see [Note: master weights] in buffers.py) would
change their math. With such an optimizer the stage lays out every bucket with each parameter whole in
one rank's shard ([Note: whole parameters per rank] in runtime/layout.py), and the optimizer is handed,
instead of the per-bucket masters, one ``nn.Parameter`` per parameter this rank owns, shaped like the
model's parameter and aliasing its range of the master. Before each step their ``.grad`` become views of
the masters' gradients (``bind_grads``), so the optimizer reads the reduced gradient and writes the
master in place; the stage then publishes the masters as usual (the all-gather of stages 1-2, the
partition itself at stage 3). Every rank steps a disjoint set of whole parameters: together, exactly the
single-process step. Stage 0 holds every bucket whole, so every rank steps every parameter.

An optimizer declares itself per-tensor with a class or instance attribute ``zero_per_tensor = True``;
``torch.optim.Muon``, ``torch.optim.Adafactor``, ``MuonWithAuxAdam`` and classes named like the known
per-tensor families (``is_per_tensor_optimizer`` in runtime/params.py) are recognised by themselves.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import nn

from ds_strategy.log import get_logger

from .buffers import GroupStorage, param_fragment
from .offload import Offload

log = get_logger(__name__)


class WholeTensors:
    """Per param group, the shaped tensors of the parameters this rank steps (see the note above); a group
    not laid out whole (``whole[g]`` false: MuonWithAuxAdam's AdamW groups) keeps its masters."""

    def __init__(self, groups: Sequence[GroupStorage], whole: Sequence[bool]) -> None:
        self.params: list[list[nn.Parameter]] = []  # per group: what the optimizer gets
        self.names: list[list[str]] = []  # per whole group: the parameters' names, lined up with ``params``
        self.groups = {g for g, flag in enumerate(whole) if flag}  # the whole groups
        self._index: list[dict[int, int]] = []  # per group: layout index -> position in ``params``
        self._links: list[tuple[nn.Parameter, nn.Parameter, int, int]] = []  # (tensor, master, lo, hi)
        for g, gs in enumerate(groups):
            if g not in self.groups:
                self.params.append(list(gs.masters))
                self.names.append([])
                self._index.append({})
                continue
            tensors: list[nn.Parameter] = []
            names: list[str] = []
            index: dict[int, int] = {}
            for i, slot in enumerate(gs.layout.params):  # the layout's order, not the shards'
                frag = param_fragment(gs, i)
                if frag is None:
                    continue
                b, lo, start, n = frag
                if start != 0 or n != slot.numel:
                    raise AssertionError(f"{slot.name} is split between shards: not a whole-parameter layout")
                master = gs.masters[b]
                tensor = nn.Parameter(master.detach()[lo : lo + n].view(slot.shape), requires_grad=True)
                self._links.append((tensor, master, lo, lo + n))
                index[i] = len(tensors)
                tensors.append(tensor)
                names.append(slot.name)
            self.params.append(tensors)
            self.names.append(names)
            self._index.append(index)

    def tensor_of(self, group: int, index: int) -> nn.Parameter | None:
        """The tensor of parameter ``index`` of a whole ``group`` if this rank steps it."""
        at = self._index[group].get(index)
        return None if at is None else self.params[group][at]

    def bind_grads(self, masters: Collection[nn.Parameter] | None = None) -> None:
        """Each tensor's ``.grad`` becomes its range of its master's gradient (``masters``: only theirs)."""
        for tensor, master, lo, hi in self._links:
            grad = master.grad
            if grad is None or (masters is not None and master not in masters):
                tensor.grad = None
                continue
            tensor.grad = grad[lo:hi].view(tensor.shape)

    def clear_grads(self) -> None:
        for tensor, *_ in self._links:
            tensor.grad = None


def optimizer_params(groups: Sequence[GroupStorage], whole: WholeTensors | None) -> list[list[nn.Parameter]]:
    """Per param group, what the optimizer steps: the masters, or a per-tensor optimizer's whole shaped
    tensors inside them (see the note above)."""
    return [list(gs.masters) for gs in groups] if whole is None else whole.params


PADDING_WARN = 1.5  # padded / parameter elements of a whole group above which rank 0 warns


def log_padding(groups: Sequence[GroupStorage], whole: WholeTensors) -> None:
    """Rank 0 logs each whole group's padding (``FlatLayout.imbalance``), warning where it is large."""
    if not groups or groups[0].rank != 0:
        return
    parts = []
    for g in sorted(whole.groups):
        padding = groups[g].layout.imbalance()
        parts.append(f"group {g}: {padding:.2f}")
        if padding > PADDING_WARN:
            log.warning(
                "per-tensor optimizer: param group %d is padded to %.2fx its elements (each parameter lies whole in "
                "one rank's shard, every shard as long as the fullest); larger buckets (reduce_bucket_size at stages "
                '1-2, stage3_fetch_units "blocks" at stage 3) balance better',
                g,
                padding,
            )
    log.info("per-tensor optimizer: parameters laid out whole, padded / parameter elements: %s", "; ".join(parts))


def owned_counts(groups: Sequence[GroupStorage]) -> list[int]:
    """Elements each rank steps, over all groups (the balance of the whole-parameter assignment)."""
    world = max((gs.layout.world_size for gs in groups), default=1)
    counts = [0] * world
    for gs in groups:
        for i, slot in enumerate(gs.layout.params):
            owner = gs.layout.owner(i)
            if owner is not None:
                counts[owner] += slot.numel
    return counts


def check_whole_params(offload: Offload, *, moe: bool, what: str) -> None:
    """Refuse what a per-tensor optimizer (``what``) cannot run under yet, naming the key at fault."""
    problems = []
    if offload.optimizer_nvme is not None:
        problems.append('offload_optimizer.device "nvme" (its swap steps flat tiles of buckets)')
    if offload.partial:
        problems.append(f"offload_optimizer.ratio {offload.ratio} (a partial offload splits buckets by size)")
    if moe:
        problems.append("ds_strategy.moe.MoE layers (expert groups checkpoint per-element state only)")
    if problems:
        raise ValueError(
            f"{what} steps each parameter whole, which ds_strategy does not combine with "
            + "; ".join(problems)
            + ". Use an element-wise optimizer (AdamW, SGD, Lion ...) there, or drop the setting"
        )
