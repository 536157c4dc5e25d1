"""Sequence-parallel and data-parallel groups for Ulysses, built once from a base group, and the active layout.

With the ranks ``r_0 .. r_{W-1}`` of the base group (the world by default) and ``sequence_parallel_size`` P:

- sequence-parallel (SP) groups are the consecutive blocks ``[r_{iP} .. r_{iP+P-1}]``: the P ranks that hold
  one sequence between them (``S / P`` tokens each) and trade sequence shards for head shards by all-to-all
  around attention (DeepSpeed's layout: consecutive ranks, so an SP group stays inside a node);
- data-parallel (DP) groups are the strided sets ``[r_j, r_{j+P}, r_{j+2P}, ...]``: the ``W / P`` ranks that
  hold the same shard position of different sequences.

``torch.distributed.new_group`` is a collective over the whole world, so every rank builds every group in
the same order: ``SequenceGroups.build`` does that once. P == 1 creates no group: there is no SP group and
the DP group is the base group.

The active layout (``set_active`` / ``active_groups``): transformers calls the attention function it finds
under ``attn_implementation`` as a plain function, ``fn(module, query, key, value, attention_mask, **kwargs)``,
with no way for us to hand it a process group; the batch adapter and the loss are called from user code
that should not have to thread the groups through either. So the layout in use is a per-process value that
the engine sets when it builds the groups and clears when it is destroyed (``set_active(groups)`` /
``set_active(None)``); everything here that takes ``groups=None`` reads it at call time. A process runs one
engine's sequence layout at a time, as it runs one set of torch.distributed groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from ds_strategy.comm import Communicator, GroupSet


def group_ranks(world: list[int], sequence_parallel_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(SP groups, DP groups) of the ranks ``world`` (global ranks, in the base group's order)."""
    size, sp = len(world), sequence_parallel_size
    if sp < 1 or size % sp:
        raise ValueError(
            f"sequence_parallel_size={sp} must divide the world size {size} (valid: "
            f"{[d for d in range(1, size + 1) if size % d == 0]})"
        )
    return [world[i : i + sp] for i in range(0, size, sp)], [world[j::sp] for j in range(sp)]


@dataclass
class SequenceGroups:
    """This rank's place in the sequence-parallel x data-parallel layout (see the module notes)."""

    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int
    sp_ranks: list[int]  # global ranks of this rank's SP group, in SP-rank order
    dp_ranks: list[int]  # global ranks of this rank's DP group
    sp_group: dist.ProcessGroup | None  # None when sp_size == 1 (no group is created)
    dp_group: dist.ProcessGroup | None  # the base group when sp_size == 1 (None: the world)
    sp_comm: Communicator | None  # None when sp_size == 1
    dp_comm: Communicator
    owned: GroupSet | None = field(default=None, repr=False, compare=False)  # the groups above, created here

    @classmethod
    def build(
        cls,
        sequence_parallel_size: int,
        group: dist.ProcessGroup | None = None,
        worker_from: Communicator | None = None,
    ) -> SequenceGroups:
        """Create the groups: a collective over the whole world (every rank calls it with the same arguments).

        ``group``: the base group whose ranks are laid out (None: the world). ``worker_from``: a communicator
        whose shared-memory worker thread the SP communicator shares ([Note: one worker for several groups]
        in comm/collectives.py).
        """
        sp = sequence_parallel_size
        if not dist.is_initialized():
            raise RuntimeError(
                f"SequenceGroups.build(sequence_parallel_size={sp}) needs an initialised torch.distributed: "
                "call ds_strategy.init_distributed() or ds_strategy.initialize(...) first"
            )
        world = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        sp_sets, dp_sets = group_ranks(world, sp)
        me = dist.get_rank()
        if me not in world:
            raise RuntimeError(f"rank {me} is not in the base group {world} the sequence groups are built from")
        if sp == 1:  # nothing to create: every rank is its own SP group, the base group is the DP group
            return cls(
                sp_size=1,
                sp_rank=0,
                dp_size=len(world),
                dp_rank=world.index(me),
                sp_ranks=[me],
                dp_ranks=list(world),
                sp_group=None,
                dp_group=group,
                sp_comm=None,
                dp_comm=Communicator(group, fast_path=False),
            )
        owned = GroupSet(attributes=("sp_group", "dp_group"))  # destroyed by close() and at exit
        # Every rank creates every group, in one order (new_group is collective over the world).
        mine_sp, sp_ranks = owned.partition(sp_sets, backend=dist.get_backend())
        mine_dp, dp_ranks = owned.partition(dp_sets, backend=dist.get_backend())
        assert mine_sp is not None and mine_dp is not None
        out = cls(
            sp,
            sp_ranks.index(me),
            len(dp_ranks),
            dp_ranks.index(me),
            sp_ranks,
            dp_ranks,
            mine_sp,
            mine_dp,
            Communicator(mine_sp, worker_from=worker_from),  # the all-to-alls: shared memory on one node
            Communicator(mine_dp, fast_path=False),
            owned,
        )
        owned.bind(out)
        return out

    def close(self) -> None:
        """Close the communicators and destroy the groups this object created (never the base group);
        clears the active layout if it is this one."""
        if _active is self:
            set_active(None)
        if self.sp_comm is not None:
            self.sp_comm.close()
        self.dp_comm.close()
        if self.owned is not None:
            self.owned.destroy()


_active: SequenceGroups | None = None


def set_active(groups: SequenceGroups | None) -> None:
    """Make ``groups`` the layout that ``groups=None`` arguments and the transformers attention function use
    (None: no sequence parallelism). The engine calls it at build and with None at destroy."""
    global _active
    _active = groups


def active_groups() -> SequenceGroups | None:
    """The layout set by ``set_active``, or None."""
    return _active
