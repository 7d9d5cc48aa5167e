"""The ``mpu`` (model-parallel unit) object, both ways: tachyon provides one and accepts one.

DeepSpeed's engine and Megatron-style training code talk about parallel groups through an object
with getters; tachyon speaks both dialects:

    mpu = mesh.mpu                                   # tachyon.parallel.Mesh(...).mpu
    mpu.get_data_parallel_world_size(), mpu.get_tensor_model_parallel_group(), ...
    view = mesh_from_mpu(megatron_mpu)               # a user's mpu as a mesh-like view
    tachyon.parallel.tensor.parallelize(model, view) # used like a Mesh

Names (each with ``_rank()``, ``_world_size()`` and ``_group()``):

    get_data_parallel_*              dp
    get_tensor_model_parallel_*      tp (Megatron)        get_slice_parallel_*  tp (DeepSpeed)
    get_pipeline_model_parallel_*    pp (Megatron)        get_pipe_parallel_*   pp (DeepSpeed)
    get_model_parallel_*             pp x tp: every rank holding a different part of one model copy
                                     (DeepSpeed's PipelineParallelGrid and Megatron-core agree: the
                                     group over which the gradient norm and overflow are reduced)

plus ``get_stage_id()``, ``is_first_stage()`` / ``is_last_stage()`` (DeepSpeed),
``is_pipeline_first_stage()`` / ``is_pipeline_last_stage()`` (Megatron),
``get_tensor_model_parallel_src_rank()``, ``get_data_parallel_src_rank()`` and
``stage_to_global(stage_id)``.

Reading a user's mpu (:func:`mesh_from_mpu`), first match wins:

- dp: ``get_data_parallel_*`` (required).
- tp: ``get_tensor_model_parallel_*`` (Megatron), else ``get_slice_parallel_*`` (DeepSpeed), else
  ``get_model_parallel_*`` when the mpu has no pipeline getters (Megatron before pipeline
  parallelism, where "model parallel" meant tensor parallel), else 1.
- pp: ``get_pipe_parallel_*`` (DeepSpeed), else ``get_pipeline_model_parallel_*`` (Megatron), else 1.

The view checks that dp * pp * tp is the world size and that each group has the size its getter
reports (ValueError otherwise).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tachyon.parallel.mesh import MODEL_PARALLEL_AXIS, check_axis

_TP_PREFIXES = ("get_tensor_model_parallel", "get_slice_parallel")
_PP_PREFIXES = ("get_pipe_parallel", "get_pipeline_model_parallel")


class ModelParallelUnit:
    """DeepSpeed's / Megatron's mpu getters over a tachyon :class:`~tachyon.parallel.Mesh` (or any
    mesh-like view). ``mesh`` is the mesh it reads."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size("dp")

    def get_data_parallel_group(self) -> Any:
        return self.mesh.group("dp")

    def get_data_parallel_src_rank(self) -> int:
        return self.mesh.ranks("dp")[0]

    # tensor parallel (Megatron names, DeepSpeed's "slice" names)
    def get_tensor_model_parallel_rank(self) -> int:
        return self.mesh.rank("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.mesh.size("tp")

    def get_tensor_model_parallel_group(self) -> Any:
        return self.mesh.group("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.ranks("tp")[0]

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    # pipeline parallel (DeepSpeed's "pipe" names, Megatron's "pipeline_model" names)
    def get_pipe_parallel_rank(self) -> int:
        return self.mesh.rank("pp")

    def get_pipe_parallel_world_size(self) -> int:
        return self.mesh.size("pp")

    def get_pipe_parallel_group(self) -> Any:
        return self.mesh.group("pp")

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_stage_id(self) -> int:
        return self.mesh.rank("pp")

    def is_first_stage(self) -> bool:
        return self.mesh.rank("pp") == 0

    def is_last_stage(self) -> bool:
        return self.mesh.rank("pp") == self.mesh.size("pp") - 1

    is_pipeline_first_stage = is_first_stage
    is_pipeline_last_stage = is_last_stage

    def stage_to_global(self, stage_id: int) -> int:
        """The global rank holding pipeline stage ``stage_id`` with this rank's dp and tp coordinates."""
        ranks = self.mesh.ranks("pp")
        if not 0 <= stage_id < len(ranks):
            raise ValueError(f"stage_to_global: stage_id={stage_id} is outside [0, {len(ranks)})")
        return ranks[stage_id]

    # model parallel = pp x tp
    def get_model_parallel_rank(self) -> int:
        return self.mesh.rank(MODEL_PARALLEL_AXIS)

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.size(MODEL_PARALLEL_AXIS)

    def get_model_parallel_group(self) -> Any:
        return self.mesh.group(MODEL_PARALLEL_AXIS)

    def __repr__(self) -> str:
        return f"ModelParallelUnit({self.mesh!r})"


def looks_like_mpu(obj: object) -> bool:
    """True for an object with the data-parallel getters every mpu has."""
    return all(callable(getattr(obj, f"get_data_parallel_{s}", None)) for s in ("rank", "world_size", "group"))


def _getters(mpu: object, prefix: str) -> tuple[Any, Any, Any] | None:
    names = [f"{prefix}_{s}" for s in ("rank", "world_size", "group")]
    found = [getattr(mpu, n, None) for n in names]
    if all(callable(f) for f in found):
        return tuple(found)  # type: ignore[return-value]
    if any(callable(f) for f in found):
        missing = [n for n, f in zip(names, found) if not callable(f)]
        raise ValueError(f"mesh_from_mpu: the mpu has some {prefix}_* getters but not {', '.join(missing)}")
    return None


class MeshFromMpu:
    """A user's mpu seen as a mesh: ``size(axis)``, ``rank(axis)``, ``group(axis)``, ``ranks(axis)``
    and ``mesh[axis]`` (a DeviceMesh over that group, made with DeviceMesh.from_group, which
    creates no group). Axes: "dp", "tp", "pp", "mp" (pp x tp, only when the mpu has
    get_model_parallel_* with that meaning). ``mpu`` is the wrapped object."""

    def __init__(self, mpu: object) -> None:
        if not looks_like_mpu(mpu):
            raise TypeError(
                f"mesh_from_mpu: {type(mpu).__name__} is not an mpu: it needs get_data_parallel_rank(), "
                "get_data_parallel_world_size() and get_data_parallel_group()"
            )
        self.mpu = mpu
        self._getters: dict[str, tuple[Any, Any, Any] | None] = {"dp": _getters(mpu, "get_data_parallel")}
        pp = next((g for g in (_getters(mpu, p) for p in _PP_PREFIXES) if g is not None), None)
        tp = next((g for g in (_getters(mpu, p) for p in _TP_PREFIXES) if g is not None), None)
        model = _getters(mpu, "get_model_parallel")
        if tp is None and pp is None and model is not None:
            tp = model  # Megatron before pipelines: "model parallel" is tensor parallel
            model = None
        self._getters.update(tp=tp, pp=pp, mp=model)
        self._device_meshes: dict[str, Any] = {}
        self._check()

    def _check(self) -> None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        dp, pp, tp = self.size("dp"), self.size("pp"), self.size("tp")
        if dp * pp * tp != world:
            raise ValueError(
                f"mesh_from_mpu: the mpu's sizes dp={dp}, pp={pp}, tp={tp} multiply to {dp * pp * tp}, not the world "
                f"size {world}"
            )
        if self._getters["mp"] is not None and self.size("mp") != pp * tp:
            raise ValueError(
                f"mesh_from_mpu: get_model_parallel_world_size() = {self.size('mp')} but pipeline x tensor parallel "
                f"= {pp} x {tp} = {pp * tp}; tachyon reads model parallel as pp x tp (DeepSpeed's and Megatron-core's meaning)"
            )
        for axis in ("dp", "tp", "pp"):
            group = self.group(axis)
            if group is not None and dist.is_initialized() and dist.get_world_size(group) != self.size(axis):
                raise ValueError(
                    f"mesh_from_mpu: the {axis} group has {dist.get_world_size(group)} ranks but the mpu reports "
                    f"size {self.size(axis)}"
                )

    def size(self, axis: str) -> int:
        getters = self._getters[check_axis(axis)]
        if getters is None and axis == MODEL_PARALLEL_AXIS:
            return self.size("pp") * self.size("tp")
        return 1 if getters is None else int(getters[1]())

    def rank(self, axis: str) -> int:
        getters = self._getters[check_axis(axis)]
        return 0 if getters is None else int(getters[0]())

    def group(self, axis: str) -> Any:
        """The mpu's group for ``axis``; None for an axis it does not have (size 1)."""
        getters = self._getters[check_axis(axis)]
        return None if getters is None else getters[2]()

    def ranks(self, axis: str) -> list[int]:
        group = self.group(axis)
        if group is None:
            return [dist.get_rank() if dist.is_initialized() else 0]
        return list(dist.get_process_group_ranks(group))

    def __getitem__(self, axis: str) -> Any:
        if axis not in self._device_meshes:
            from torch.distributed.device_mesh import DeviceMesh

            from tachyon.parallel.mesh import default_device_type

            group = self.group(axis)
            if group is None:
                raise ValueError(f"mesh_from_mpu: the mpu has no {axis} group")
            self._device_meshes[axis] = DeviceMesh.from_group(group, default_device_type(), mesh_dim_names=(axis,))
        return self._device_meshes[axis]

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: self.size(axis) for axis in ("pp", "dp", "tp")}

    def __repr__(self) -> str:
        return f"MeshFromMpu({type(self.mpu).__name__}: dp={self.size('dp')}, pp={self.size('pp')}, tp={self.size('tp')})"


def mesh_from_mpu(mpu: object) -> Any:
    """Wrap a Megatron / DeepSpeed ``mpu`` as a mesh-like view (see the module docstring); a tachyon
    ModelParallelUnit gives back its own mesh."""
    if isinstance(mpu, ModelParallelUnit):
        return mpu.mesh
    return MeshFromMpu(mpu)


__all__ = ["MeshFromMpu", "ModelParallelUnit", "looks_like_mpu", "mesh_from_mpu"]
