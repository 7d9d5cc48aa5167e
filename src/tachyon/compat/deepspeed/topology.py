"""DeepSpeed's process topologies (``deepspeed.pipe.ProcessTopology`` and its pipeline /
data / model specialisations): a named Cartesian grid of ranks, the last axis varying fastest.

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)   # axes pipe, data, model
    topo.get_rank(pipe=1, data=0, model=1)  # 5
    topo.get_axis_comm_lists("data")        # the ranks that differ only in "data"

They are pure bookkeeping (no process groups). A pipeline / data / model topology passed to
``PipelineModule(topology=...)`` becomes the `tachyon.parallel.Mesh` with the same rank layout
(tachyon's mesh orders its axes pp, dp, tp, as these do).

``PipelineParallelGrid(topology)`` (DeepSpeed's grid, also an ``mpu``) holds the process groups
of such a topology: they are that Mesh's groups (pipe = "pp", data = "dp", model = "tp", and
DeepSpeed's model-parallel group, every rank of one model copy, = "mp").
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


def _prime_factors(n: int) -> list[int]:
    """The prime factors of a positive integer, smallest first (with repeats)."""
    if n <= 0:
        raise ValueError(f"_prime_factors needs a positive integer; got {n}")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


class PipelineParallelGrid:
    """DeepSpeed's ``PipelineParallelGrid(topology=None)``: this rank's coordinate in a
    pipe / data[ / model] topology and the process groups along its axes (collective: every rank
    constructs it), built as the `tachyon.parallel.Mesh` of the same layout (``grid.mesh``).
    Without a topology the world is split as DeepSpeed splits it: alternate prime factors of the
    world size to pipe and data. The getters are DeepSpeed's mpu names (``get_stage_id``,
    ``get_data_parallel_group``, ``get_slice_parallel_rank``, ``stage_to_global``, ...); the lists
    ``dp_group``, ``pp_group``, ``slice_group`` are this rank's groups' ranks, ``dp_groups``,
    ``pipe_groups`` every group's, ``p2p_groups`` each rank with its next stage's rank."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None):
        import torch.distributed as dist

        if process_group is not None:
            raise NotImplementedError("PipelineParallelGrid(process_group=...): the grid spans the whole job (DeepSpeed "
                                      "ignores the argument too); leave it out")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("PipelineParallelGrid needs torch.distributed initialized (deepspeed.init_distributed())")
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if topology is None:
            num_pp = num_dp = 1
            for i, prime in enumerate(_prime_factors(self.world_size)):
                num_pp, num_dp = (num_pp * prime, num_dp) if i % 2 == 0 else (num_pp, num_dp * prime)
            topology = PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)
        self._topo = topology
        if not self._is_grid_valid():
            raise ValueError(f"PipelineParallelGrid: the topology {topology.get_axis_names()} x {topology.dims} holds "
                             f"{topology.world_size()} ranks, the job has {self.world_size}")
        self.mesh = topology_to_mesh(topology)  # every group, created on every rank
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id = self.get_stage_id()
        self.data_parallel_id = self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # DeepSpeed's "model parallel" group: every rank holding a part of this rank's model copy
        self.ds_model_proc_group = self.mesh.group("mp")
        model_ranks = sorted(topology.get_axis_list("data", self.data_parallel_id))
        self.ds_model_world_size = len(model_ranks)
        self.ds_model_rank = model_ranks.index(self.global_rank)
        self.dp_groups = topology.get_axis_comm_lists("data")
        self.dp_group = self.mesh.ranks("dp")
        self.dp_proc_group = self.mesh.group("dp")
        self.pipe_groups = topology.get_axis_comm_lists("pipe")
        self.pp_group = self.mesh.ranks("pp")
        self.pp_proc_group = self.mesh.group("pp")
        self.p2p_groups = self._build_p2p_groups()
        if self.model_parallel_size > 1:
            self.mp_group: list[int] = []
            self.model_groups = topology.get_axis_comm_lists("model")
        self.slice_group = self.mesh.ranks("tp")
        self.slice_proc_group = self.mesh.group("tp")

    def _build_p2p_groups(self) -> list[list[int]]:
        """[rank, the rank of the next stage (the last stage's next is the first)] for every rank."""
        pairs = {}
        for ranks in self._topo.get_axis_comm_lists("pipe") or [list(range(self.world_size))]:
            for i, rank in enumerate(ranks):
                pairs[rank] = [rank, ranks[(i + 1) % len(ranks)]]
        return [pairs[rank] for rank in range(self.world_size)]

    def _is_grid_valid(self) -> bool:
        size = 1
        for axis in self._topo.get_axis_names():
            size *= self._topo.get_dim(axis)
        return size == self.world_size

    def get_stage_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).data

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank at pipeline stage ``stage_id`` with this rank's other coordinates
        (each ``axis=value`` given replaces this rank's)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **coords)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self._topo.get_coord(rank=self.global_rank).model if "model" in self._topo.get_axis_names() else 0

    get_tensor_model_parallel_rank = get_slice_parallel_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    get_tensor_model_parallel_world_size = get_slice_parallel_world_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    get_tensor_model_parallel_group = get_slice_parallel_group


__all__ = ["PipeDataParallelTopology", "PipelineParallelGrid", "PipeModelDataParallelTopology", "ProcessTopology", "topology_to_mesh"]
