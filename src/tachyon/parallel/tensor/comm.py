"""The collectives of tensor and sequence parallelism, as autograd functions (Megatron's mappings).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) splits each GEMM pair so that one
all-reduce in the forward and one in the backward suffice per block:

    copy_to_tp        forward identity          backward all-reduce     (input of a column-parallel GEMM)
    reduce_from_tp    forward all-reduce        backward identity       (output of a row-parallel GEMM)
    gather_from_tp    forward all-gather(dim)   backward keep own slice (gather_output=True)
    scatter_to_tp     forward keep own slice    backward all-gather     (entering a sharded region)

Sequence parallelism (Korthikanti et al. 2022) keeps the activations between the blocks split
along the sequence, so the norms and dropouts run on 1/tp of the tokens; the all-reduce becomes a
reduce-scatter plus an all-gather (the same bytes):

    gather_from_sp        forward all-gather(seq)       backward reduce-scatter(seq)   (before a column-parallel GEMM)
    reduce_scatter_to_sp  forward reduce-scatter(seq)   backward all-gather(seq)       (after a row-parallel GEMM)

Every function is the identity at tp size 1 and takes the group as a :class:`TPGroup`. Shapes:
any tensor; ``dim`` is the split dimension (the hidden/vocab dim for tensor parallelism, the
sequence dim for sequence parallelism); all-gathers return ``contiguous`` tensors tp times larger
along ``dim``, reduce-scatters and scatters tp times smaller (``dim`` must divide evenly). Nothing
is saved for backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


# torch 2.13 renamed the one-tensor collectives (the old names warn); looked up by name at call
# time, so a wrapper installed on torch.distributed (CommCounter) sees every call.
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: the process group, its size and this rank's position in it."""

    group: Any
    size: int
    rank: int


def tp_group(mesh: Any) -> TPGroup:
    """The "tp" axis of a mesh-like object (tachyon Mesh, mesh_from_mpu view, mpu), or a ProcessGroup."""
    if isinstance(mesh, TPGroup):
        return mesh
    if isinstance(mesh, dist.ProcessGroup):
        return TPGroup(mesh, dist.get_world_size(mesh), dist.get_rank(mesh))
    from tachyon.parallel.mesh import as_mesh

    mesh = as_mesh(mesh)
    return TPGroup(mesh.group("tp"), mesh.size("tp"), mesh.rank("tp"))


def _all_reduce(x: Tensor, tp: TPGroup) -> Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_along(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    """[..., n, ...] -> [..., tp * n, ...] along ``dim``, rank order (plain collective, no autograd)."""
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((tp.size * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    getattr(dist, _ALL_GATHER)(out, front, group=tp.group)
    return out.movedim(0, dim).contiguous()


def _check_divisible(x: Tensor, tp: TPGroup, dim: int, what: str) -> None:
    if x.shape[dim] % tp.size:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} has {x.shape[dim]} entries, not divisible by "
            f"the tensor-parallel size {tp.size} (with sequence parallelism the sequence length must be a multiple of tp)"
        )


def reduce_scatter_along(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    """Sum over the group, then keep this rank's 1/tp slice along ``dim`` (no autograd)."""
    _check_divisible(x, tp, dim, "reduce-scatter")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // tp.size, *front.shape[1:]), dtype=x.dtype, device=x.device)
    getattr(dist, _REDUCE_SCATTER)(out, front, group=tp.group)
    return out.movedim(0, dim).contiguous()


def own_slice(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    """This rank's 1/tp slice along ``dim`` (a contiguous copy)."""
    _check_divisible(x, tp, dim, "split")
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


def _same(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    return x.view_as(x)


def _summed(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    return _all_reduce(x, tp)


class _Mapping(torch.autograd.Function):
    """``forward_op(x, tp, dim)`` forward, ``backward_op(grad, tp, dim)`` backward: each pair of
    the module docstring's tables is one (forward_op, backward_op)."""

    @staticmethod
    def forward(ctx, x, tp, dim, forward_op, backward_op):
        ctx.tp, ctx.dim, ctx.backward_op = tp, dim, backward_op
        return forward_op(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.tp, ctx.dim), None, None, None, None


def copy_to_tp(x: Tensor, tp: TPGroup) -> Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, 0, _same, _summed)


def reduce_from_tp(x: Tensor, tp: TPGroup) -> Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, 0, _summed, _same)


def gather_from_tp(x: Tensor, tp: TPGroup, dim: int = -1) -> Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, dim % x.dim(), all_gather_along, own_slice)


def scatter_to_tp(x: Tensor, tp: TPGroup, dim: int = -1) -> Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, dim % x.dim(), own_slice, all_gather_along)


def gather_from_sp(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, dim % x.dim(), all_gather_along, reduce_scatter_along)


def reduce_scatter_to_sp(x: Tensor, tp: TPGroup, dim: int) -> Tensor:
    return x if tp.size == 1 else _Mapping.apply(x, tp, dim % x.dim(), reduce_scatter_along, all_gather_along)


def all_reduce_grads_over_tp(param: torch.nn.Parameter, tp: TPGroup) -> None:
    """Sum ``param``'s gradient over the group on every backward use (registered once per param).

    For parameters replicated across tensor-parallel ranks but applied to different tokens on each
    (sequence parallelism: the norms, the biases added after a reduce-scatter): each rank's
    gradient covers its own tokens only. Megatron sums these once per step; a hook per use keeps
    the module self-contained (correct under gradient accumulation and pipelines with no engine
    call), at the price of one small all-reduce per parameter per micro-batch.
    """
    if tp.size == 1 or getattr(param, "_tp_grad_hook", None) is not None:
        return

    def hook(grad: Tensor) -> Tensor:
        return _all_reduce(grad, tp)

    param._tp_grad_hook = param.register_hook(hook)  # type: ignore[attr-defined]
    param.sequence_parallel = True  # type: ignore[attr-defined]  (Megatron's attribute name)


__all__ = [
    "TPGroup", "all_gather_along", "all_reduce_grads_over_tp", "copy_to_tp", "gather_from_sp", "gather_from_tp",
    "own_slice", "reduce_from_tp", "reduce_scatter_along", "reduce_scatter_to_sp", "scatter_to_tp", "tp_group",
]
