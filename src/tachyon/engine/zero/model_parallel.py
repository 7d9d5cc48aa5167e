"""What the ZeRO strategy needs to know when the model itself is split (tensor / pipeline parallel).

With tensor parallelism a rank holds 1/tp of each split weight and a full copy of the replicated
ones (norms, biases after a row-parallel sum); with pipeline parallelism a rank holds one stage,
and a tied weight (the embedding reused as the LM head) has a copy on each stage using it. The
global gradient norm (for clipping) must count every parameter of the whole model once
(Megatron's rule, `tachyon.parallel.tensor.shard.is_replica_duplicate`):

    norm^2 = sum over tp and pp ranks of (this rank's squares, without its duplicates)

where a duplicate is a replicated parameter on a tensor-parallel rank other than 0, or a tied
weight's copy on a pipeline rank that does not own it (`PipelineModule.owns_tied`). Their
gradients equal the counted copy's (the tensor-parallel backward all-reduces the input gradient
of every split region; pipelines sum the tied copies' gradients), so dropping them loses nothing.
The same rule says which rank writes a parameter into a checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TIED_PREFIX = "tied_modules."


def is_duplicate_name(module: nn.Module, name: str, param: torch.Tensor, tp: Any) -> bool:
    """Whether parameter (or buffer) ``name`` of ``module`` is counted by another rank (module
    docstring). ``tp``: the TPGroup, or None without tensor parallelism."""
    if tp is not None and tp.size > 1:
        from tachyon.parallel.tensor.shard import is_replica_duplicate

        if is_replica_duplicate(param, tp):
            return True
    owns = getattr(module, "owns_tied", None)
    if callable(owns) and name.startswith(TIED_PREFIX):
        key = name[len(TIED_PREFIX):].split(".", 1)[0]
        return not owns(key)
    return False


def tp_of(mesh: Any) -> Any:
    """The mesh's TPGroup, None without a mesh or at tp size 1."""
    if mesh is None or mesh.size("tp") == 1:
        return None
    from tachyon.parallel.tensor import tp_group

    return tp_group(mesh)


def duplicate_parameters(module: nn.Module, mesh: Any) -> set[int]:
    """``id()`` of the parameters of ``module`` another rank counts (module docstring)."""
    tp = tp_of(mesh)
    return {id(p) for name, p in module.named_parameters() if is_duplicate_name(module, name, p, tp)}


class ModelParallelSum:
    """SUM all-reduce of a small fp32 tensor over every rank holding another part of this
    model copy: the mesh's pp x tp "model parallel" group (one all-reduce), or, where the mesh
    has none (a user's mpu need not provide it), the tensor-parallel then the pipeline group."""

    def __init__(self, mesh: Any) -> None:
        both = mesh.size("tp") > 1 and mesh.size("pp") > 1
        mp = mesh.group("mp") if both else None  # a tachyon Mesh has the flattened group: one all-reduce
        self.groups = [mp] if mp is not None else [mesh.group(axis) for axis in ("tp", "pp") if mesh.size(axis) > 1]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            dist.all_reduce(tensor, group=group)
        return tensor


__all__ = ["ModelParallelSum", "duplicate_parameters", "is_duplicate_name", "tp_of"]
