"""Process topologies: how global ranks map onto named axes (DeepSpeed's ``ProcessTopology`` semantics).

A topology is a row-major grid: ``axes=["pipe", "data"]`` with ``dims=[2, 3]`` puts rank ``pipe * 3 + data``
at coordinate ``(pipe, data)``; the last axis varies fastest. Pipeline stages talk along ``pipe``, ZeRO
reduces along ``data``.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any, cast


class ProcessTopology:
    """Maps every global rank to a coordinate on ``axes`` of sizes ``dims`` (row-major)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology: every dim must be >= 1, got {dict(zip(axes, dims, strict=False))}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord: Any = cast(Any, namedtuple)("ProcessCoord", self.axes)
        self.mapping: dict[Any, int] = {}
        ranges = [range(d) for d in self.dims]
        for rank, coord in enumerate(itertools.product(*ranges)):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord_kwargs: int) -> int:
        """The global rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs every axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            dims = dict(zip(self.axes, self.dims, strict=True))
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_rank_repr(
        self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ) -> str:
        """A string naming ``rank``'s coordinate on the axes not omitted (``"model_01"``), for file names."""
        coord = self.get_coord(rank)
        parts = [f"{ax}{inner_sep}{getattr(coord, ax):02d}" for ax in self.axes if ax not in omit_axes]
        return outer_sep.join(parts)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis`` (0 when the topology has no such axis, as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in the topology (world size {self.world_size()})")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that differ only in ``axis``: the communicator groups along it."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for other in itertools.product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, other, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinate matches every given ``axis=value``."""
        return [
            r
            for c, r in sorted(self.mapping.items(), key=lambda kv: kv[1])
            if all(getattr(c, k) == v for k, v in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks at position ``idx`` of ``axis``."""
        if axis not in self.axes:
            return []
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ``["pipe", "data"]`` (neighbouring ranks are data-parallel peers)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism: axes ``["pipe", "data", "model"]``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
