"""DeepSpeed's process topologies (``deepspeed.pipe.ProcessTopology`` and its pipeline /
data / model specialisations): a named Cartesian grid of ranks, the last axis varying fastest.

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)   # axes pipe, data, model
    topo.get_rank(pipe=1, data=0, model=1)  # 5
    topo.get_axis_comm_lists("data")        # the ranks that differ only in "data"

They are pure bookkeeping (no process groups). A pipeline / data / model topology passed to
``PipelineModule(topology=...)`` becomes the `tachyon.parallel.Mesh` with the same rank layout
(tachyon's mesh orders its axes pp, dp, tp, as these do).
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any


class ProcessTopology:
    """Ranks laid out on a grid with named ``axes`` of sizes ``dims``; rank = row-major index."""

    def __init__(self, axes: list[str], dims: list[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology needs distinct axis names, one per dimension; got {axes}, {dims}")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord: int) -> int:
        """The rank at a coordinate; every axis must be given."""
        if set(coord) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis {self.axes}; got {sorted(coord)}")
        return self.mapping[self.ProcessCoord(**coord)]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``"model_01"``-style name of a rank's coordinate, without the omitted axes."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in set(omit_axes))

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, index in self.mapping.items():
            if index == rank:
                return coord
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """Groups of ranks that differ only along ``axis`` (one group per coordinate of the others)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for coord in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, coord))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filters: int) -> list[int]:
        """Ranks whose coordinate matches every ``axis=value`` given."""
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, axis) == value for axis, value in filters.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate along ``axis`` is ``idx``."""
        position = self.axes.index(axis)
        return [rank for coord, rank in self.mapping.items() if coord[position] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline and data parallelism: axes ("pipe", "data")."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and model (tensor) parallelism: axes ("pipe", "data", "model")."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def topology_to_mesh(topology: ProcessTopology) -> Any:
    """The tachyon Mesh with ``topology``'s rank layout (axes pipe, data[, model] in that order)."""
    axes = topology.get_axis_names()
    if axes not in (["pipe", "data"], ["pipe", "data", "model"]):
        raise ValueError(f"a topology with axes {axes} has no tachyon mesh; use pipe, data (and model) in that order")
    from tachyon.parallel.mesh import Mesh

    return Mesh(pp=topology.get_dim("pipe"), dp=topology.get_dim("data"), tp=max(1, topology.get_dim("model")))


__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology", "topology_to_mesh"]
