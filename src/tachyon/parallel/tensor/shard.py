"""How a tensor-parallel parameter relates to the full one, and moving between the two.

A sharded parameter carries a :class:`ShardSpec` (``param._tp_shard``) plus Megatron's attributes
``tensor_model_parallel = True`` and ``partition_dim``. Most shards are one contiguous 1/tp slice
along ``dim``. Fused weights are not: the QKV weight stacks [Q heads | K heads | V heads] along
its rows and a gated fc1 stacks [gate | up], and each rank must get its own heads of each block,
so the full tensor is cut into ``blocks`` along ``dim``, each block split into tp parts, and the
local shard is the concatenation of this rank's part of every block::

    full rows  [ Q0 Q1 | K0 K1 | V0 V1 ]        (tp = 2, blocks = (h*d, g*d, g*d))
    rank 0     [ Q0 | K0 | V0 ]      rank 1  [ Q1 | K1 | V1 ]

(which is also why these shards are not a DTensor ``Shard(dim)`` placement: a checkpoint saves
them block by block, see :func:`full_state_dict` / :func:`shard_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tachyon.parallel.tensor.comm import TPGroup


@dataclass(frozen=True)
class ShardSpec:
    """dim: the split dimension of the full tensor. blocks: sizes along ``dim`` of the blocks that
    are split separately (None: the whole dim is one block). tp: number of shards. full_shape:
    the unsharded shape."""

    dim: int
    tp: int
    full_shape: tuple[int, ...]
    blocks: tuple[int, ...] | None = None

    def block_sizes(self) -> tuple[int, ...]:
        return self.blocks if self.blocks is not None else (self.full_shape[self.dim],)

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] //= self.tp
        return tuple(shape)


def check_shardable(what: str, size: int, tp: int, name: str) -> None:
    """ValueError unless ``size`` (a count of heads, features, rows) divides evenly over tp ranks."""
    if size % tp:
        raise ValueError(f"{what}: {name}={size} is not divisible by the tensor-parallel size tp={tp}; "
                         f"choose tp among the divisors of {size}")


def shard_tensor(full: Tensor, spec: ShardSpec, rank: int) -> Tensor:
    """This rank's shard of ``full`` (a contiguous copy)."""
    parts = torch.split(full, list(spec.block_sizes()), dim=spec.dim)
    return torch.cat([p.chunk(spec.tp, dim=spec.dim)[rank] for p in parts], dim=spec.dim).contiguous()


def unshard_tensor(shards: list[Tensor], spec: ShardSpec) -> Tensor:
    """The full tensor from every rank's shard, in rank order (inverse of shard_tensor)."""
    local_blocks = [b // spec.tp for b in spec.block_sizes()]
    per_rank = [torch.split(s, local_blocks, dim=spec.dim) for s in shards]
    return torch.cat([per_rank[r][b] for b in range(len(local_blocks)) for r in range(spec.tp)], dim=spec.dim)


def shard_parameter(param: nn.Parameter, tp: TPGroup, dim: int, blocks: tuple[int, ...] | None = None) -> None:
    """Replace ``param``'s data by this rank's shard, in place (the Parameter object stays, so
    modules sharing it, e.g. a tied embedding and LM head, stay tied). A parameter already sharded
    the same way is left alone; sharded differently is an error."""
    dim = dim % param.dim()
    existing = getattr(param, "_tp_shard", None)
    if existing is not None:
        if existing.dim != dim or existing.tp != tp.size or existing.blocks != blocks:
            raise ValueError(f"a shared (tied) parameter is sharded as {existing} and again along dim {dim} with "
                             f"blocks {blocks}: tied modules must split it the same way")
        return
    full_shape = tuple(param.shape)
    spec = ShardSpec(dim, tp.size, full_shape, blocks)
    if blocks is not None and sum(blocks) != full_shape[dim]:
        raise ValueError(f"blocks {blocks} do not add up to dim {dim} of shape {full_shape}")
    with torch.no_grad():
        param.data = shard_tensor(param.data, spec, tp.rank)
    param._tp_shard = spec  # type: ignore[attr-defined]
    param.tensor_model_parallel = True  # type: ignore[attr-defined]  (Megatron's attribute names)
    param.partition_dim = dim  # type: ignore[attr-defined]


def shard_spec(param: Tensor) -> ShardSpec | None:
    """The ShardSpec of a tensor-parallel parameter, None for a replicated one."""
    return getattr(param, "_tp_shard", None)


def is_replica_duplicate(param: Tensor, tp: TPGroup) -> bool:
    """True for a replicated parameter on a tensor-parallel rank other than 0: its copy on rank 0
    already counts (Megatron's ``not param_is_not_tensor_parallel_duplicate``), e.g. when summing
    squared gradients for the global norm over the model-parallel group."""
    return shard_spec(param) is None and tp.rank != 0


def full_state_dict(model: nn.Module, tp: TPGroup) -> dict[str, Tensor]:
    """model.state_dict() with every tensor-parallel parameter gathered to its full shape (on
    every rank; a collective over the tp group). Keys and full shapes are those of the model
    before ``parallelize``, so the result loads into the single-process model."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        spec = shard_spec(params[key]) if key in params else None
        if spec is None or tp.size == 1:
            out[key] = value
            continue
        shards = [torch.empty_like(value) for _ in range(tp.size)]
        dist.all_gather(shards, value.contiguous(), group=tp.group)
        out[key] = unshard_tensor(shards, spec)
    return out


def shard_state_dict(model: nn.Module, full: dict[str, Tensor], tp: TPGroup) -> dict[str, Tensor]:
    """The inverse of :func:`full_state_dict`: this rank's slices of a full (single-process)
    state dict, ready for ``model.load_state_dict``. ValueError when a full tensor's shape is not
    the one the parameter was sharded from."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, Tensor] = {}
    for key, value in full.items():
        spec = shard_spec(params[key]) if key in params else None
        if spec is None:
            out[key] = value
            continue
        if tuple(value.shape) != spec.full_shape:
            raise ValueError(f"shard_state_dict: {key} has shape {tuple(value.shape)}; the model was sharded from "
                             f"{spec.full_shape}")
        out[key] = shard_tensor(value, spec, tp.rank)
    return out


__all__ = ["ShardSpec", "check_shardable", "full_state_dict", "is_replica_duplicate", "shard_parameter", "shard_spec",
           "shard_state_dict", "shard_tensor", "unshard_tensor"]
