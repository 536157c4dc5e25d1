"""Expert-parallel and expert-data-parallel groups, built once per ``ep_size`` from a data-parallel group.

With data-parallel ranks ``r_0 .. r_{W-1}`` (the engine's group; the world by default) and ``ep_size`` E:

- expert-parallel (EP) groups are the consecutive blocks ``[r_{iE} .. r_{iE+E-1}]``: the E ranks that
  hold the ``num_experts`` experts between them (``num_experts / E`` each) and exchange tokens by
  all-to-all;
- expert-data-parallel (EDP) groups are the strided sets ``[r_j, r_{j+E}, r_{j+2E}, ...]``: the ``W / E``
  replicas of the same experts, which reduce the experts' gradients among themselves.

So the dense parameters are reduced over W ranks and the experts over ``W / E``; expert ``e`` lives on
EP rank ``e // (num_experts / E)`` (DeepSpeed's layout). ``torch.distributed.new_group`` is a
collective over the whole world, so every rank builds every group in the same order: ``ExpertGroups.build``
does that once, and the engine hands one object per ``ep_size`` to every MoE layer using it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from ds_strategy.comm import Communicator, GroupSet


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert group of ``ep_size`` (the ``group_name`` tag of expert parameters)."""
    return f"ep_size_{ep_size}"


def group_ranks(world: list[int], ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, EDP groups) of the ranks ``world`` (global ranks, in data-parallel order)."""
    size = len(world)
    if ep_size < 1 or size % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must divide the data-parallel world size {size} (valid: "
            f"{[d for d in range(1, size + 1) if size % d == 0]})"
        )
    ep = [world[i : i + ep_size] for i in range(0, size, ep_size)]
    edp = [world[j::ep_size] for j in range(ep_size)]
    return ep, edp


@dataclass
class ExpertGroups:
    """This rank's expert-parallel and expert-data-parallel communicators for one ``ep_size``."""

    ep_size: int
    ep_comm: Communicator
    edp_comm: Communicator
    ep_ranks: list[int]  # global ranks of this rank's expert-parallel group
    edp_ranks: list[int]  # global ranks of this rank's expert-data-parallel group
    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    owned: GroupSet | None = field(default=None, repr=False, compare=False)  # the groups above, created here

    @property
    def name(self) -> str:
        return expert_group_name(self.ep_size)

    @property
    def ep_rank(self) -> int:
        return self.ep_comm.rank

    @classmethod
    def build(
        cls, ep_size: int, group: dist.ProcessGroup | None = None, worker_from: Communicator | None = None
    ) -> ExpertGroups:
        """Create the groups (a collective over the whole world: every rank calls it, same arguments).
        ``worker_from``: the data-parallel communicator whose shared-memory worker thread the expert
        communicators share ([Note: one worker for several groups] in comm/collectives.py)."""
        if not dist.is_initialized():
            if ep_size != 1:
                raise RuntimeError(
                    f"ep_size={ep_size} spreads experts over processes: initialise torch.distributed first "
                    "(ds_strategy.init_distributed() or ds_strategy.initialize(...))"
                )
            raise RuntimeError("ExpertGroups.build needs an initialised torch.distributed")
        world = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        ep, edp = group_ranks(world, ep_size)
        me = dist.get_rank()
        # Every rank creates every group, in one order (new_group is collective over the world).
        owned = GroupSet(attributes=("ep_group", "edp_group"))  # destroyed by close() and at exit
        mine_ep, ep_ranks = owned.partition(ep, backend=dist.get_backend())
        mine_edp, edp_ranks = owned.partition(edp, backend=dist.get_backend())
        if mine_ep is None or mine_edp is None:
            raise RuntimeError(f"rank {me} is not in the data-parallel group {world} the expert groups were built from")
        out = cls(
            ep_size,
            Communicator(mine_ep, worker_from=worker_from),  # the shared-memory all-to-all on one node
            Communicator(mine_edp, fast_path=False),
            ep_ranks,
            edp_ranks,
            mine_ep,
            mine_edp,
            owned,
        )
        owned.bind(out)
        return out

    def close(self) -> None:
        """Close the communicators and destroy the groups (this object created them; comm/ownership.py)."""
        self.ep_comm.close()
        self.edp_comm.close()
        if self.owned is not None:
            self.owned.destroy()
