"""Which (dp, pp, tp) layout a training job runs, decided before any process group exists.

`tachyon.initialize` reads the layout from, first match wins:

    mpu=                 a Megatron / DeepSpeed mpu or a tachyon mesh's ``mesh.mpu``: its groups
    a PipelineModule     the mesh it was built over (its ``topology``): pp and tp
    the config           ``pipeline.stages`` and ``tensor_parallel.tp_size``
    nothing              dp = every rank (plain data parallelism, no mesh)

and refuses, naming the problem, a layout that does not fit: sizes whose product does not divide
the world; a config that disagrees with the mpu or the PipelineModule; ``pipeline.stages > 1``
for a model that is not a PipelineModule (only a layer list can be cut into stages); a model
already made tensor parallel with no mpu saying over which ranks. :func:`check_layout` runs
tensor parallelism's own checks (heads, key/value heads, FFN size and vocabulary divisible by
tp) on the model, still without touching it. Only :func:`build_mesh` creates process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from tachyon.config import ConfigError, TachyonConfig


@dataclass(frozen=True)
class Layout:
    """dp x pp x tp = the world size. ``source``: where pp and tp came from ("mpu", "pipeline
    module", "config" or "none"); ``sequence_parallel``: split the hidden states between layers."""

    dp: int
    pp: int
    tp: int
    source: str
    sequence_parallel: bool = False

    @property
    def model_parallel(self) -> int:
        return self.pp * self.tp


def _is_pipeline(model: object) -> bool:
    from tachyon.parallel.pipeline import PipelineModule

    return isinstance(model, PipelineModule)


def check_mpu(mpu: object) -> None:
    """ValueError unless ``mpu`` is a model-parallel unit (a Megatron / DeepSpeed mpu, a tachyon
    ``Mesh(...).mpu``, or a mesh_from_mpu view) and torch.distributed is running (its groups
    are process groups). Reads nothing from it yet."""
    from tachyon.parallel.mpu import MeshFromMpu, ModelParallelUnit, looks_like_mpu

    if not (isinstance(mpu, (ModelParallelUnit, MeshFromMpu)) or looks_like_mpu(mpu)):
        raise ValueError(
            f"mpu should be a model-parallel unit with get_data_parallel_rank(), get_data_parallel_world_size() and "
            f"get_data_parallel_group() (a Megatron / DeepSpeed mpu, or tachyon.parallel.Mesh(...).mpu); got "
            f"{type(mpu).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("mpu= needs torch.distributed initialized before initialize() (its groups are process groups); "
                         "call tachyon.init_distributed() and build the mpu's groups first")


def _mpu_view(mpu: object) -> Any:
    from tachyon.parallel.mpu import MeshFromMpu, ModelParallelUnit, mesh_from_mpu

    check_mpu(mpu)
    if isinstance(mpu, MeshFromMpu):
        return mpu
    return mesh_from_mpu(mpu)  # a tachyon ModelParallelUnit gives its own mesh back


def resolve_layout(model: nn.Module, mpu: object, config: TachyonConfig, world_size: int) -> Layout:
    """The job's layout (module docstring); pure apart from reading an mpu's getters."""
    stages, tp_cfg = config.pipeline.num_stages, config.tensor_parallel
    tp_given = tp_cfg.tp_size is not None or tp_cfg.autotp_size is not None
    pipeline = _is_pipeline(model)
    if mpu is not None:
        view, source = _mpu_view(mpu), "mpu"
        pp, tp = view.size("pp"), view.size("tp")
        if pipeline and model.mesh is not None and (model.mesh.size("pp"), model.mesh.size("tp")) != (pp, tp):
            raise ValueError(
                f"the PipelineModule was built over pp={model.mesh.size('pp')}, tp={model.mesh.size('tp')} but mpu= has "
                f"pp={pp}, tp={tp}; pass the mesh the module was built with (or no mpu)"
            )
    elif pipeline and model.mesh is not None:
        pp, tp, source = model.mesh.size("pp"), model.mesh.size("tp"), "pipeline module"
    elif pipeline:
        pp, tp, source = 1, tp_cfg.size, "config"
    else:
        pp, tp, source = stages or 1, tp_cfg.size, "config" if (stages or tp_given) else "none"
    where = {"mpu": "the mpu", "pipeline module": "the PipelineModule's mesh"}.get(source)
    if where is not None and stages is not None and stages != pp:
        raise ConfigError(f"`pipeline.stages: {stages}` but {where} has {pp} pipeline stages; make them agree "
                          '(or write "stages": "auto")')
    if where is not None and tp_given and tp_cfg.size != tp:
        hint = (f"; build the PipelineModule with topology=tachyon.parallel.Mesh(pp={pp}, tp={tp_cfg.size}) to split its "
                "layers too" if source == "pipeline module" else "")
        raise ConfigError(f"`tensor_parallel.tp_size: {tp_cfg.size}` but {where} has tensor-parallel size {tp}; make "
                          f"them agree (or leave tp_size out){hint}")
    if pipeline and stages is not None and stages != model.num_stages:
        raise ConfigError(f"`pipeline.stages: {stages}` but the PipelineModule has num_stages={model.num_stages}")
    if pp > 1 and not pipeline:
        raise ValueError(
            f"pipeline parallelism over {pp} stages needs the model as a tachyon.parallel.pipeline.PipelineModule (a "
            f"layer list tachyon can cut into stages); got {type(model).__name__}. Build a PipelineModule (see "
            "docs/parallelism.md) or set pipeline.stages to 1"
        )
    already = getattr(model, "_tachyon_tp", None)
    if already is not None and already.size != tp:
        raise ValueError(
            f"the model is already tensor parallel over {already.size} ranks but the layout has tp={tp}; pass "
            "mpu=mesh.mpu of the mesh it was split over (or give initialize the unsplit model and tensor_parallel.tp_size)"
        )
    if world_size % (pp * tp):
        error = ConfigError if source == "config" else ValueError
        raise error(f"pipeline stages x tensor-parallel size = {pp} x {tp} = {pp * tp} (from {where or 'the config'}) "
                    f"does not divide the world size {world_size}; the data-parallel size world / (pp x tp) must be a "
                    "whole number")
    if tp_cfg.sequence_parallel and tp == 1:
        raise ConfigError("`tensor_parallel.sequence_parallel: true` needs a tensor-parallel size > 1 (it splits the "
                          "sequence over the tensor-parallel ranks)")
    return Layout(world_size // (pp * tp), pp, tp, source, tp_cfg.sequence_parallel)


def check_layout(model: nn.Module, layout: Layout) -> None:
    """Tensor parallelism's checks on the model for ``layout`` (nothing is changed): ValueError
    naming the module and the size that tp does not divide."""
    if layout.tp > 1 and getattr(model, "_tachyon_tp", None) is None:
        from tachyon.parallel.tensor import check_parallelizable

        check_parallelizable(model, layout.tp, sequence_parallel=layout.sequence_parallel)


def build_mesh(layout: Layout, model: nn.Module, mpu: object) -> Any:
    """The mesh the engine runs on: the mpu's view, the PipelineModule's mesh, a new
    ``Mesh(pp=, tp=)`` (process groups created here, on every rank), or None for plain data
    parallelism (layout 1 x 1 and no mpu)."""
    if mpu is not None:
        return _mpu_view(mpu)
    if _is_pipeline(model) and model.mesh is not None:
        return model.mesh
    if layout.model_parallel == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"a {layout.pp} x {layout.tp} (pp x tp) layout needs torch.distributed: launch with torchrun "
                         "(or tachyon launch)")
    from tachyon.parallel.mesh import Mesh

    return Mesh(pp=layout.pp, tp=layout.tp)


__all__ = ["Layout", "build_mesh", "check_layout", "check_mpu", "resolve_layout"]
