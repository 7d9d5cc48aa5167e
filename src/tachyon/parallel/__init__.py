"""Distributed start-up, launcher, the device mesh, tensor and pipeline parallelism. Modules in tachyon.nn never import this.

- `tachyon.parallel.distributed`: init_distributed (torchrun / OpenMPI / SLURM environments), the
  stored process-group timeout and `new_group` that always passes it, get_rank/get_world_size/get_local_rank,
  `shutdown_distributed` (barrier, then every group destroyed; run at exit after init_distributed).
- `tachyon.parallel.launch`: ``tachyon launch``, which builds and runs a torchrun command.
- `tachyon.parallel.mesh`: `Mesh(dp=, pp=, tp=)`, the ranks as a (pp, dp, tp) grid over torch's
  DeviceMesh, with process groups by axis name.
- `tachyon.parallel.mpu`: the DeepSpeed / Megatron ``mpu`` getters over a Mesh (``mesh.mpu``) and
  `mesh_from_mpu`, which reads a user's mpu as a mesh.
- `tachyon.parallel.tensor`: tensor and sequence parallelism (`parallelize(model, mesh)`,
  ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy).
- `tachyon.parallel.pipeline`: PipelineModule / LayerSpec / TiedLayerSpec and `PipelineSchedule`
  (GPipe, 1F1B, interleaved 1F1B over torch.distributed.pipelining: train_batch, eval_batch).
- `CommCounter` (tachyon.parallel.tensor.comm_counter): bytes every torch.distributed call moves, by
  mesh axis.

Names below load lazily, so ``import tachyon.parallel`` stays cheap.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_LAZY = {
    "Mesh": "tachyon.parallel.mesh",
    "as_mesh": "tachyon.parallel.mesh",
    "ModelParallelUnit": "tachyon.parallel.mpu",
    "mesh_from_mpu": "tachyon.parallel.mpu",
    "CommCounter": "tachyon.parallel.tensor.comm_counter",
    "parallelize": "tachyon.parallel.tensor",
    "PipelineModule": "tachyon.parallel.pipeline",
    "LayerSpec": "tachyon.parallel.pipeline",
    "TiedLayerSpec": "tachyon.parallel.pipeline",
    "PipelineSchedule": "tachyon.parallel.pipeline",
}

_SUBMODULES = ("distributed", "launch", "mesh", "mpu", "tensor", "pipeline")

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"tachyon.parallel.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tachyon.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
