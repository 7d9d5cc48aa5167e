"""Megatron's tensor-parallel layers on tachyon's FP8-capable Linear, and vocab-parallel cross-entropy.

    col = ColumnParallelLinear(1024, 4096, mesh)                 # weight [4096 / tp, 1024] on each rank
    row = RowParallelLinear(4096, 1024, mesh)                    # weight [1024, 4096 / tp]
    y = row(gelu(col(x)))                                        # x, y [..., 1024] replicated; one all-reduce
    emb = VocabParallelEmbedding(50304, 1024, mesh)              # weight [50304 / tp, 1024]
    loss = vocab_parallel_cross_entropy(logits_shard, labels, mesh)   # logits_shard [..., vocab / tp]

Why tachyon's own layers and not DTensor's ``parallelize_module`` (ColwiseParallel, ...): the
GEMM is tachyon's ``fp8_linear`` (FP8 inside fp8_autocast) and the fused modules run custom ops
(norms, bias + activation, attention) that DTensor's sharding propagation has no rules for; and
tachyon's ZeRO partitions plain local tensors into flat buffers, which DTensor parameters would
not be. Parameters here are ordinary tensors holding the local shard, tagged with a ShardSpec
(tachyon.parallel.tensor.shard) so checkpoints can gather or re-slice them.

Converting existing modules in place (what ``parallelize`` does): :func:`to_column_parallel`,
:func:`to_row_parallel`, :func:`to_vocab_parallel` shard the parameters (the Parameter objects
stay, so ties survive) and swap the module's class for the parallel subclass, so state_dict keys
do not change (FSDP2's ``fully_shard`` swaps classes the same way). A torch ``nn.Linear``
becomes ``ColumnParallelTorchLinear`` / ``RowParallelTorchLinear`` (F.linear, no FP8 state, same
state_dict keys), a tachyon ``Linear`` becomes ``ColumnParallelLinear`` / ``RowParallelLinear``.

Sequence parallelism: with ``sequence_parallel=True`` a column-parallel layer takes its input
split along ``seq_dim`` and all-gathers it (backward: reduce-scatter), a row-parallel layer
reduce-scatters its output along ``seq_dim`` instead of all-reducing it, and the embedding
reduce-scatters its output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tachyon.fp8.linear import fp8_linear
from tachyon.nn.attention import takes_fused_calls
from tachyon.nn.linear import Linear, check_input, compute_dtype, te_outputs
from tachyon.parallel.tensor.comm import (
    TPGroup, all_reduce_grads_over_tp, copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
    reduce_scatter_to_sp, scatter_to_tp, tp_group,
)
from tachyon.parallel.tensor.shard import check_shardable, shard_parameter


_SUBCLASSES: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, parallel: type) -> None:
    """Make ``module`` an instance of ``parallel`` (a subclass of the module's base class whose
    methods place the collectives). A user subclass of the base keeps its identity and its own
    methods where the parallel class does not override them: its class becomes
    ``Parallel<Name>(parallel, <its class>)`` (made once per pair, like FSDP2's ``FSDP<Name>``), so
    e.g. a TransformerLayer subclass that prepares RoPE tables in its forward keeps doing so. A
    method the parallel class overrides (the projections' forward) replaces the subclass's."""
    cls = type(module)
    if issubclass(cls, parallel):
        return
    base = next(b for b in parallel.__mro__[1:] if b not in (_ColumnParallel, _RowParallel))
    if cls is base:
        module.__class__ = parallel
        return
    key = (parallel, cls)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"Parallel{cls.__name__}", (parallel, cls), {"__module__": cls.__module__})
    module.__class__ = _SUBCLASSES[key]


def _set_tp(module: nn.Module, tp: TPGroup, sequence_parallel: bool, seq_dim: int) -> None:
    module.tp, module.sequence_parallel, module.seq_dim = tp, bool(sequence_parallel), seq_dim


def _gemm(module: nn.Module, x: Tensor, bias: Tensor | None, is_first_microbatch: bool | None) -> Tensor:
    """x @ weight.T (+ bias) in the compute dtype: tachyon's fp8_linear for a tachyon Linear,
    F.linear for a converted torch nn.Linear (which has no FP8 state)."""
    dtype = compute_dtype(module.weight, x)
    weight, bias = module.weight.to(dtype), (bias.to(dtype) if bias is not None else None)
    scaling = getattr(module, "fp8_scaling", None)
    if scaling is None:
        return F.linear(x.to(dtype), weight, bias)
    return fp8_linear(x.to(dtype), weight, bias, scaling["gemm"], is_first_microbatch=is_first_microbatch)


class _ColumnParallel:
    """forward of the column-parallel layers (mixed into tachyon's Linear and torch's nn.Linear)."""

    @takes_fused_calls
    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, return_bias: bool | None = None):
        check_input("ColumnParallelLinear", x, self.in_features)
        return_bias = self.return_bias if return_bias is None else return_bias
        x = gather_from_sp(x, self.tp, self.seq_dim) if self.sequence_parallel else copy_to_tp(x, self.tp)
        bias = self.bias.to(compute_dtype(self.weight, x)) if self.bias is not None else None
        y = _gemm(self, x, None if return_bias else bias, is_first_microbatch)
        if self.gather_output:
            y = gather_from_tp(y, self.tp, -1)
            if bias is not None and return_bias:
                bias = gather_from_tp(bias, self.tp, -1)
        return te_outputs(y, bias, None, return_bias, False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local), tp={self.tp.size}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class _RowParallel:
    """forward of the row-parallel layers (mixed into tachyon's Linear and torch's nn.Linear)."""

    @takes_fused_calls
    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, return_bias: bool | None = None):
        return_bias = self.return_bias if return_bias is None else return_bias
        if not self.input_is_parallel:
            check_input("RowParallelLinear", x, self.in_features * self.tp.size)
            x = scatter_to_tp(x, self.tp, -1)
        check_input("RowParallelLinear", x, self.in_features)
        y = _gemm(self, x, None, is_first_microbatch)
        y = reduce_scatter_to_sp(y, self.tp, self.seq_dim) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        bias = self.bias.to(y.dtype) if self.bias is not None else None
        if return_bias:
            return y, bias
        return y + bias if bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local), out_features={self.out_features}, tp={self.tp.size}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ColumnParallel, Linear):
    """y = x @ W.T + b with W split by rows (output features): each rank computes out/tp features.

    in_features, out_features: the full sizes. mesh: a tachyon Mesh, mpu, mesh_from_mpu view or
    tp ProcessGroup (its "tp" axis is used). gather_output: all-gather the output features (else
    y is this rank's [..., out_features / tp] slice, what a RowParallelLinear takes).
    sequence_parallel / seq_dim: x arrives split along seq_dim and is all-gathered first. Other
    arguments as tachyon.nn.Linear; the full weight is initialized (same on every rank for the
    same seed) and then sliced, so a model starts from the same values at any tp.

    forward(x [..., in_features], is_first_microbatch=None, *, return_bias=None) -> [..., out_features / tp]
    ([..., out_features] with gather_output); with return_bias (the module's setting unless given
    for the call), (y, bias) where bias is this rank's slice (gathered with gather_output). ``out_features`` is the local count after
    construction. Saved for backward: what tachyon.nn.Linear saves.
    """

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, gather_output: bool = False,
                 init_method=None, params_dtype=None, device=None, return_bias: bool = False, *,
                 sequence_parallel: bool = False, seq_dim: int = 0) -> None:
        Linear.__init__(self, in_features, out_features, bias, init_method, params_dtype, device, return_bias)
        to_column_parallel(self, mesh, gather_output=gather_output, sequence_parallel=sequence_parallel, seq_dim=seq_dim)


class RowParallelLinear(_RowParallel, Linear):
    """y = x @ W.T + b with W split by columns (input features): partial products summed over tp.

    in_features, out_features: the full sizes. input_is_parallel: x is already this rank's
    [..., in_features / tp] slice (a ColumnParallelLinear's output); else it is split here.
    sequence_parallel / seq_dim: the sum is a reduce-scatter along seq_dim (y split along the
    sequence) instead of an all-reduce. The bias is replicated and added once, after the sum.

    forward(x [..., in_features / tp], is_first_microbatch=None, *, return_bias=None) -> [..., out_features]
    (split along seq_dim with sequence parallelism); with return_bias (the module's setting unless
    given for the call), (y without bias, bias).
    ``in_features`` is the local count after construction. Saved for backward: what
    tachyon.nn.Linear saves.
    """

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True, input_is_parallel: bool = True,
                 init_method=None, params_dtype=None, device=None, return_bias: bool = False, *,
                 sequence_parallel: bool = False, seq_dim: int = 0) -> None:
        Linear.__init__(self, in_features, out_features, bias, init_method, params_dtype, device, return_bias)
        to_row_parallel(self, mesh, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                        seq_dim=seq_dim)


class ColumnParallelTorchLinear(_ColumnParallel, nn.Linear):
    """A torch nn.Linear converted by :func:`to_column_parallel` (same state_dict keys, F.linear GEMM)."""


class RowParallelTorchLinear(_RowParallel, nn.Linear):
    """A torch nn.Linear converted by :func:`to_row_parallel` (same state_dict keys, F.linear GEMM)."""


def _parallel_class(module: nn.Module, tachyon_cls: type, torch_cls: type, what: str) -> type:
    if isinstance(module, Linear):
        return tachyon_cls
    if isinstance(module, nn.Linear):
        return torch_cls
    raise TypeError(f"{what}: expected a tachyon.nn.Linear or torch.nn.Linear; got {type(module).__name__}")


def to_column_parallel(module: nn.Module, mesh, *, gather_output: bool = False, sequence_parallel: bool = False,
                       seq_dim: int = 0, blocks: tuple[int, ...] | None = None) -> nn.Module:
    """Shard a tachyon.nn.Linear or torch nn.Linear in place by output features (it becomes a
    ColumnParallelLinear / ColumnParallelTorchLinear); ``blocks``: row blocks split separately
    (a fused QKV weight). Returns the module."""
    tp = tp_group(mesh)
    cls = _parallel_class(module, ColumnParallelLinear, ColumnParallelTorchLinear, "to_column_parallel")
    check_shardable(f"ColumnParallelLinear({module.in_features}, {module.out_features})", module.out_features, tp.size,
                    "out_features")
    if blocks is not None:
        for block in blocks:
            check_shardable("ColumnParallelLinear (a fused weight block)", block, tp.size, "rows")
    shard_parameter(module.weight, tp, 0, blocks)
    if module.bias is not None:
        shard_parameter(module.bias, tp, 0, blocks)
    module.return_bias = getattr(module, "return_bias", False)
    swap_class(module, cls)
    _set_tp(module, tp, sequence_parallel, seq_dim)
    module.gather_output = bool(gather_output)
    module.out_features //= tp.size
    return module


def to_row_parallel(module: nn.Module, mesh, *, input_is_parallel: bool = True, sequence_parallel: bool = False,
                    seq_dim: int = 0) -> nn.Module:
    """Shard a tachyon.nn.Linear or torch nn.Linear in place by input features (it becomes a
    RowParallelLinear / RowParallelTorchLinear). With sequence parallelism the (replicated) bias
    is added to a sequence slice, so its gradient is summed over tp. Returns the module."""
    tp = tp_group(mesh)
    cls = _parallel_class(module, RowParallelLinear, RowParallelTorchLinear, "to_row_parallel")
    check_shardable(f"RowParallelLinear({module.in_features}, {module.out_features})", module.in_features, tp.size,
                    "in_features")
    shard_parameter(module.weight, tp, 1)
    module.return_bias = getattr(module, "return_bias", False)
    swap_class(module, cls)
    _set_tp(module, tp, sequence_parallel, seq_dim)
    module.input_is_parallel = bool(input_is_parallel)
    module.in_features //= tp.size
    if sequence_parallel and module.bias is not None:
        all_reduce_grads_over_tp(module.bias, tp)
    return module


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding with its rows (the vocabulary) split over tp ranks: rank r holds ids
    [r V/tp, (r+1) V/tp); each rank looks up the ids it holds, writes zeros for the others, and
    the partial outputs are summed (all-reduce; a reduce-scatter along seq_dim with sequence
    parallelism).

    num_embeddings (V, divisible by tp), embedding_dim, mesh, padding_idx, dtype/device: as
    nn.Embedding (the full table is initialized, then sliced). forward(ids [...] int64) ->
    [..., embedding_dim] (split along seq_dim with sequence parallelism). Saved for backward: the
    local ids and the out-of-range mask (as nn.Embedding saves its indices).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh, padding_idx: int | None = None, *,
                 dtype=None, device=None, sequence_parallel: bool = False, seq_dim: int = 1) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, dtype=dtype, device=device)
        to_vocab_parallel(self, mesh, sequence_parallel=sequence_parallel, seq_dim=seq_dim)

    def forward(self, ids: Tensor) -> Tensor:
        start = self.vocab_start_index
        outside = (ids < start) | (ids >= start + self.num_embeddings)
        local = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                          self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(out, self.tp, self.seq_dim) if self.sequence_parallel else reduce_from_tp(out, self.tp)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local, ids from {self.vocab_start_index}), {self.embedding_dim}, "
                f"tp={self.tp.size}, sequence_parallel={self.sequence_parallel}")


def to_vocab_parallel(embedding: nn.Embedding, mesh, *, sequence_parallel: bool = False,
                      seq_dim: int = 1) -> VocabParallelEmbedding:
    """Shard an nn.Embedding's rows in place and make it a VocabParallelEmbedding."""
    tp = tp_group(mesh)
    if not isinstance(embedding, nn.Embedding):
        raise TypeError(f"to_vocab_parallel: expected an nn.Embedding; got {type(embedding).__name__}")
    if embedding.max_norm is not None:
        raise ValueError("VocabParallelEmbedding: max_norm is not supported (it renormalizes rows across shards)")
    vocab = embedding.num_embeddings
    check_shardable(f"VocabParallelEmbedding({vocab}, {embedding.embedding_dim})", vocab, tp.size, "num_embeddings (vocab)")
    per_rank = vocab // tp.size
    shard_parameter(embedding.weight, tp, 0)
    swap_class(embedding, VocabParallelEmbedding)
    _set_tp(embedding, tp, sequence_parallel, seq_dim)
    embedding.vocab_start_index = tp.rank * per_rank
    embedding.num_embeddings = per_rank
    pad = embedding.padding_idx
    embedding.padding_idx = pad - tp.rank * per_rank if pad is not None and 0 <= pad - tp.rank * per_rank < per_rank else None
    return embedding  # type: ignore[return-value]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-split logits (Megatron's algorithm): the max, the sum of
    exponentials and the target logit are each reduced over tp, so no rank holds full logits.
    Saves the local softmax [..., V/tp] (fp32) and the target mask for backward."""

    @staticmethod
    def forward(ctx, logits, target, tp, start, ignore_index):
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - row_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        outside = (target < start) | (target >= start + vocab_local)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([picked, sum_exp])
        dist.all_reduce(both, group=tp.group)
        picked, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - picked
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_((grad_loss.masked_fill(ignored, 0.0)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, mesh, *, ignore_index: int = -100,
                                 reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits split over the vocabulary (a column-parallel LM head's output).

    logits: [..., V / tp], this rank's vocabulary slice (rank r holds ids [r V/tp, (r+1) V/tp)),
    any float dtype (computed in fp32). target: [...] int64 global ids, ``ignore_index`` for
    unscored positions. reduction: "mean" (over scored positions, as F.cross_entropy), "sum" or
    "none" (per position, 0 where ignored). Returns fp32, the same value on every tp rank.
    """
    tp = tp_group(mesh)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none'; got {reduction!r}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be target's shape "
                         f"{tuple(target.shape)} plus a vocabulary dim")
    if tp.size == 1:
        per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                    ignore_index=ignore_index, reduction="none").view(target.shape)
    else:
        per_token = _VocabParallelCrossEntropy.apply(logits, target, tp, tp.rank * logits.shape[-1], ignore_index)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (target != ignore_index).sum()


__all__ = [
    "ColumnParallelLinear", "ColumnParallelTorchLinear", "RowParallelLinear", "RowParallelTorchLinear",
    "VocabParallelEmbedding", "to_column_parallel", "to_row_parallel",
    "to_vocab_parallel", "vocab_parallel_cross_entropy",
]
