"""``Mesh``: the job's ranks as a (pp, dp, tp) grid with named axes, over torch's DeviceMesh.

    import tachyon
    tachyon.init_distributed()
    mesh = tachyon.parallel.Mesh(dp=2, pp=2, tp=2)       # 8 ranks; dp=None infers it
    mesh.size("tp"), mesh.rank("tp"), mesh.group("tp")  # this rank's tensor-parallel group
    mesh["dp"]                                          # the 1-d DeviceMesh of that axis
    mesh.mpu                                            # DeepSpeed / Megatron names (tachyon.parallel.mpu)

Layout: ranks fill the grid with ``tp`` fastest, then ``dp``, then ``pp`` (DeepSpeed's
PipeModelDataParallelTopology axes ['pipe', 'data', 'model'] and Megatron's default order), so a
tensor-parallel group is ``tp`` adjacent ranks: on a multi-GPU node they share NVLink, which the
per-layer all-reduces of tensor parallelism need most; pipeline neighbours, which only exchange one
activation per micro-batch, sit farthest apart. With 8 ranks and dp=pp=tp=2::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank
    tp groups: [0,1] [2,3] [4,5] [6,7]   dp groups: [0,2] [1,3] [4,6] [5,7]   pp groups: [0,4] [1,5] [2,6] [3,7]

Besides the three axes the mesh holds ``mp``, the flattened pp x tp group (every rank that holds a
different part of one model copy: DeepSpeed's and Megatron's "model parallel" group, over which the
global gradient norm and fp16 overflow are reduced).

Every group is created here, up front, on every rank: creating a process group is a collective
over the whole job, so a group created lazily on some ranks only would hang. Validation comes
first, so a bad layout is refused before any group exists.

A Megatron-style ``mpu`` from user code becomes a mesh-like view with
:func:`tachyon.parallel.mpu.mesh_from_mpu`; everything in tachyon.parallel accepts either
(:func:`as_mesh`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from tachyon.parallel.mpu import ModelParallelUnit

AXES = ("pp", "dp", "tp")  # outermost (slowest varying) first
MODEL_PARALLEL_AXIS = "mp"  # the flattened pp x tp group
ALL_AXES = (*AXES, MODEL_PARALLEL_AXIS)


class MeshLike(Protocol):
    """What tachyon.parallel needs from a mesh: sizes, coordinates and groups by axis name."""

    def size(self, axis: str) -> int: ...
    def rank(self, axis: str) -> int: ...
    def group(self, axis: str) -> Any: ...
    def ranks(self, axis: str) -> list[int]: ...


def check_axis(axis: object) -> str:
    if axis not in ALL_AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; allowed: {', '.join(map(repr, ALL_AXES))}")
    return axis  # type: ignore[return-value]


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Mesh: {name} must be an int >= 1; got {value!r}")
    return value


def resolve_sizes(world_size: int, dp: int | None, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp, pp, tp) checked against ``world_size`` (pure: no process group is touched).

    dp=None takes the ranks left over, world_size / (pp * tp). ValueError names the problem:
    a size that is not a positive int, pp * tp not dividing the world size, or dp * pp * tp !=
    world size.
    """
    pp, tp = _check_size("pp", pp), _check_size("tp", tp)
    if dp is None:
        if world_size % (pp * tp):
            raise ValueError(
                f"Mesh: pp * tp = {pp} * {tp} = {pp * tp} does not divide the world size {world_size}; "
                f"the data-parallel size would be {world_size / (pp * tp):g} (choose pp and tp whose product divides "
                f"{world_size})"
            )
        dp = world_size // (pp * tp)
    dp = _check_size("dp", dp)
    if dp * pp * tp != world_size:
        raise ValueError(
            f"Mesh: dp * pp * tp = {dp} * {pp} * {tp} = {dp * pp * tp} does not match the world size {world_size}; "
            f"the three sizes must multiply to the number of ranks (or pass dp=None to infer dp = world / (pp * tp))"
        )
    return dp, pp, tp


def default_device_type() -> str:
    """"cuda" when the default process group runs NCCL, else "cpu" (gloo)."""
    if torch.cuda.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return "cuda"
    return "cpu"


class Mesh:
    """The (pp, dp, tp) grid of the job's ranks, with a process group per axis.

    Args:
        dp: data-parallel size (None: world_size / (pp * tp)).
        pp: pipeline stages (ranks along the pipeline).
        tp: tensor-parallel size (ranks that split each layer).
        device_type: the DeviceMesh's device type; default "cuda" under NCCL, else "cpu".

    Needs torch.distributed initialized (``tachyon.init_distributed()``, which also works for a
    single process). Raises ValueError before creating any group when the sizes do not multiply
    to the world size.

    Attributes and methods: ``device_mesh`` (the 3-d DeviceMesh, axis names "pp", "dp", "tp"),
    ``mesh[axis]`` (the 1-d DeviceMesh of one axis, what DTensor APIs take), ``size(axis)``,
    ``rank(axis)`` (this rank's coordinate along the axis), ``group(axis)``, ``ranks(axis)`` (the
    global ranks of this rank's group along the axis, in axis order), ``sizes`` and
    ``coordinate`` (dicts), ``mpu`` (DeepSpeed / Megatron getters). Axis "mp" is the flattened
    pp x tp group.
    """

    def __init__(self, dp: int | None = None, pp: int = 1, tp: int = 1, *, device_type: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "Mesh needs torch.distributed initialized: call tachyon.init_distributed() first (it also works "
                "for a single process)"
            )
        world = dist.get_world_size()
        self.dp, self.pp, self.tp = resolve_sizes(world, dp, pp, tp)
        device_type = device_type or default_device_type()
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"Mesh: device_type must be 'cpu' or 'cuda'; got {device_type!r}")
        from torch.distributed.device_mesh import init_device_mesh

        self.device_type = device_type
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=AXES)
        # DeviceMesh has no public way to name a group over two non-adjacent axes; _flatten is what
        # torchtitan uses for its flattened dp_shard_cp / dp_cp axes. Created here, on every rank.
        self._mp_mesh = self.device_mesh["pp", "tp"]._flatten(MODEL_PARALLEL_AXIS)
        self._mpu: ModelParallelUnit | None = None

    # ------------------------------------------------------------------ axes
    def __getitem__(self, axis: str) -> DeviceMesh:
        """The 1-d DeviceMesh of ``axis`` containing this rank (for DTensor / FSDP2 / pipelining)."""
        if check_axis(axis) == MODEL_PARALLEL_AXIS:
            return self._mp_mesh
        return self.device_mesh[axis]

    def size(self, axis: str) -> int:
        axis = check_axis(axis)
        return self.pp * self.tp if axis == MODEL_PARALLEL_AXIS else getattr(self, axis)

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (its rank inside the axis group)."""
        return self[axis].get_local_rank()

    def group(self, axis: str) -> Any:
        """This rank's process group along ``axis``."""
        return self[axis].get_group()

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, ordered by coordinate."""
        return [int(r) for r in self[axis].mesh.flatten().tolist()]

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    @property
    def coordinate(self) -> dict[str, int]:
        return {axis: self.rank(axis) for axis in AXES}

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at a grid coordinate."""
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"Mesh.rank_of: {name}={value} is outside [0, {size})")
        return int(self.device_mesh.mesh[pp, dp, tp])

    @property
    def mpu(self) -> ModelParallelUnit:
        """DeepSpeed's / Megatron's model-parallel unit over this mesh (see tachyon.parallel.mpu)."""
        if self._mpu is None:
            from tachyon.parallel.mpu import ModelParallelUnit

            self._mpu = ModelParallelUnit(self)
        return self._mpu

    def __repr__(self) -> str:
        return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}, device_type={self.device_type!r})"


def as_mesh(obj: object) -> MeshLike:
    """A mesh-like object from a tachyon Mesh, a view made by mesh_from_mpu, or a DeepSpeed /
    Megatron ``mpu`` (wrapped with mesh_from_mpu). TypeError for anything else."""
    from tachyon.parallel.mpu import MeshFromMpu, ModelParallelUnit, looks_like_mpu, mesh_from_mpu

    if isinstance(obj, (Mesh, MeshFromMpu)):
        return obj
    if isinstance(obj, ModelParallelUnit):
        return obj.mesh
    if looks_like_mpu(obj):
        return mesh_from_mpu(obj)
    raise TypeError(
        f"expected a tachyon.parallel.Mesh, a Megatron / DeepSpeed mpu (get_data_parallel_world_size(), ...) or "
        f"mesh_from_mpu(mpu); got {type(obj).__name__}"
    )


__all__ = ["ALL_AXES", "AXES", "Mesh", "MeshLike", "as_mesh", "resolve_sizes"]
