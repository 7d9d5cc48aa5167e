"""Tensor parallelism for tachyon's fused modules, applied from outside (tachyon.nn is untouched).

The fused modules (LayerNormLinear, LayerNormMLP, MultiheadAttention, TransformerLayer) run
tachyon's custom ops, so DTensor cannot shard them by propagation. Instead each module's
parameters are sliced in place and its class is swapped for a subclass whose forward places the
collectives (tachyon.parallel.tensor.comm) between the same kernels the module runs:

    MultiheadAttention   QKV (LayerNormLinear or Linear): column-parallel by heads, Q/K/V blocks
                         split separately, so rank r keeps query heads [r h/tp, (r+1) h/tp) and
                         their key/value groups; attention runs on the local heads; ``proj``:
                         row-parallel (one all-reduce, or a reduce-scatter with sequence parallelism)
    LayerNormMLP         norm (replicated) -> fc1 column-parallel ([gate | up] blocks split
                         separately for geglu/swiglu) -> bias + activation on the local features ->
                         fc2 row-parallel -> one all-reduce (reduce-scatter) -> fc2 bias
    TransformerLayer     the two above; residual adds, dropouts and the output norm stay as they are

The parallel forwards take the single-device modules' keyword arguments (``return_bias``,
``return_input_branch``, ``input_is_normalized``; marked with ``takes_fused_calls``), so a
tensor-parallel TransformerLayer runs the single-device layer's fused path: x's residual
gradient summed by norm1's backward, packed attention with the QKV bias (or RoPE) inside, the
residual add fused with the MLP's norm, one seed draw per forward. With sequence parallelism the
norms and the residual adds run on this rank's sequence slice and the column-parallel GEMMs
gather it (the norm's output, the tensor the single-device layer passes on).

Per layer and micro-batch: 2 all-reduces of [tokens, hidden] forward and 2 backward (Megatron's
count); with sequence parallelism each becomes a reduce-scatter plus an all-gather.

With sequence parallelism, the norms' parameters and the biases added after the reduce-scatter
see only this rank's tokens; their gradients are summed over tp (comm.all_reduce_grads_over_tp).
Dropout on split data (attention probabilities always; the hidden dropouts with sequence
parallelism) gets per-rank seeds: in the layer's one draw (tachyon.parallel.tensor.rng.tp_seeds),
or, for a call drawing its own seed, under tp_distinct_rng.
"""

from __future__ import annotations

from torch import Tensor, nn

from tachyon.fp8.linear import fp8_linear
from tachyon.nn.attention import DotProductAttention, MultiheadAttention, takes_fused_calls
from tachyon.nn.layernorm_linear import LayerNormLinear, apply_norm
from tachyon.nn.layernorm_mlp import GATED, LayerNormMLP, ffn
from tachyon.nn.linear import Linear, check_input, compute_dtype, te_outputs
from tachyon.nn.transformer_layer import _SITE_ATTN_PROBS, _SITE_INTER_PROBS, TransformerLayer
from tachyon.parallel.tensor.comm import (
    TPGroup, all_reduce_grads_over_tp, copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp,
)
from tachyon.parallel.tensor.layers import swap_class, to_column_parallel, to_row_parallel
from tachyon.parallel.tensor.rng import tp_distinct_rng, tp_seeds
from tachyon.parallel.tensor.shard import check_shardable, shard_parameter


def _enter_gemm(x: Tensor, module: nn.Module) -> Tensor:
    """Input of a column-parallel GEMM: all-gather the sequence (sequence parallel) or mark the
    point where the backward all-reduces the input gradient."""
    return gather_from_sp(x, module.tp, module.seq_dim) if module.sequence_parallel else copy_to_tp(x, module.tp)


def _leave_gemm(y: Tensor, module: nn.Module) -> Tensor:
    """Output of a row-parallel GEMM: sum the partial products (reduce-scatter the sequence)."""
    return reduce_scatter_to_sp(y, module.tp, module.seq_dim) if module.sequence_parallel else reduce_from_tp(y, module.tp)


def _mark_replicated_grads(params, tp: TPGroup, sequence_parallel: bool) -> None:
    if sequence_parallel:
        for p in params:
            if p is not None:
                all_reduce_grads_over_tp(p, tp)


class ParallelLayerNormLinear(LayerNormLinear):
    """LayerNormLinear with a column-parallel GEMM: the norm runs on the (replicated, or with
    sequence parallelism this rank's sequence slice of the) input, then the GEMM on the local
    output features. forward as LayerNormLinear (return_bias, return_input_branch included), out
    [..., out_features / tp] (full sequence), bias this rank's slice; ln_out and the input branch,
    when returned, are before the gather (this rank's slice: what the residual needs)."""

    @takes_fused_calls
    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, return_bias: bool | None = None,
                return_input_branch: bool = False):
        check_input("LayerNormLinear", x, self.in_features)
        return_bias = self.return_bias if return_bias is None else return_bias
        dtype = compute_dtype(self.weight, x)
        ln_out = apply_norm(self, x.to(dtype), dtype, return_input_branch)
        ln_out, x_branch = ln_out if return_input_branch else (ln_out, None)
        bias = self.bias.to(dtype) if self.bias is not None else None
        out = fp8_linear(_enter_gemm(ln_out, self), self.weight.to(dtype), None if return_bias else bias,
                         self.fp8_scaling["gemm"], is_first_microbatch=is_first_microbatch)
        result = te_outputs(out, bias, ln_out, return_bias, self.return_layernorm_output)
        if not return_input_branch:
            return result
        return (*(result if isinstance(result, tuple) else (result,)), x_branch)


class ParallelLayerNormMLP(LayerNormMLP):
    """LayerNormMLP with fc1 column-parallel and fc2 row-parallel (``ffn_hidden_size`` is the local
    count). forward as LayerNormMLP (input_is_normalized included): x [..., hidden] -> y
    [..., hidden] (x and y this rank's sequence slice with sequence parallelism); fc2_bias is
    added after the sum."""

    @takes_fused_calls
    def forward(self, x: Tensor, is_first_microbatch: bool | None = None, *, input_is_normalized: bool = False):
        check_input("LayerNormMLP", x, self.hidden_size)
        dtype = compute_dtype(self.fc1_weight, x)
        ln_out = x.to(dtype) if input_is_normalized else apply_norm(self, x.to(dtype), dtype)
        fc1_bias = self.fc1_bias.to(dtype) if self.fc1_bias is not None else None
        y = _leave_gemm(ffn(self, _enter_gemm(ln_out, self), dtype, fc1_bias, None, is_first_microbatch), self)
        fc2_bias = self.fc2_bias.to(dtype) if self.fc2_bias is not None else None
        if fc2_bias is not None and not self.return_bias:
            y = y + fc2_bias
        return te_outputs(y, fc2_bias, ln_out, self.return_bias, self.return_layernorm_output)


class ParallelDotProductAttention(DotProductAttention):
    """DotProductAttention over this rank's heads; a call given no dropout seed draws it from a
    per-rank stream (TransformerLayer passes per-rank seeds from its one draw)."""

    def _draw_seed(self, device):
        with tp_distinct_rng(device, self.tp.rank):
            return super()._draw_seed(device)


class ParallelTransformerLayer(TransformerLayer):
    """TransformerLayer (its fused path) whose one seed draw gives the dropouts on split data
    per-rank seeds: the attention probabilities always (each rank holds other heads), the hidden
    dropouts under sequence parallelism (each rank holds other tokens); the hidden dropouts on
    replicated activations keep one seed on every rank, or the replicas would drift apart."""

    def _seed_draw(self, device, sites):
        split = [site in (_SITE_ATTN_PROBS, _SITE_INTER_PROBS) or self.sequence_parallel for site in range(sites)]
        return tp_seeds(device, self.tp.size, self.tp.rank, split)

    def _draw_hidden_seed(self, device):
        if self.sequence_parallel:
            with tp_distinct_rng(device, self.tp.rank):
                return super()._draw_hidden_seed(device)
        return super()._draw_hidden_seed(device)


def _set(module: nn.Module, tp: TPGroup, sequence_parallel: bool, seq_dim: int) -> None:
    module.tp, module.sequence_parallel, module.seq_dim = tp, bool(sequence_parallel), seq_dim


def seq_dim_of(layer: TransformerLayer) -> int:
    """The sequence dimension of a layer's hidden states: 1 for bshd, 0 for sbhd."""
    return 1 if layer.attn_input_format == "bshd" else 0


def check_transformer_layer(layer: TransformerLayer, tp: int, name: str) -> None:
    """ValueError naming the layer unless tp divides its query heads, key/value heads and FFN size."""
    attn = layer.self_attention
    what = f"tensor parallel {name or 'TransformerLayer'}"
    check_shardable(what, attn.num_attention_heads, tp, "num_attention_heads")
    check_shardable(what, attn.num_gqa_groups, tp, "num_gqa_groups (key/value heads)")
    check_shardable(what, layer.layernorm_mlp.ffn_hidden_size, tp, "ffn_hidden_size")
    if getattr(layer, "tp", None) is not None:
        raise ValueError(f"{what}: the layer is already tensor parallel (parallelize was applied twice)")


def _column_input(module: nn.Module, tp: TPGroup, sp: bool, seq_dim: int, blocks: tuple[int, ...] | None) -> None:
    """The input projection of an attention block: LayerNormLinear or Linear, column-parallel."""
    if isinstance(module, LayerNormLinear):
        shard_parameter(module.weight, tp, 0, blocks)
        if module.bias is not None:
            shard_parameter(module.bias, tp, 0, blocks)
        module.out_features //= tp.size
        swap_class(module, ParallelLayerNormLinear)
        _set(module, tp, sp, seq_dim)
        _mark_replicated_grads((module.layer_norm_weight, module.layer_norm_bias), tp, sp)
    elif isinstance(module, Linear):
        to_column_parallel(module, tp, sequence_parallel=sp, seq_dim=seq_dim, blocks=blocks)
    else:
        raise TypeError(f"unexpected attention input projection {type(module).__name__}")


def parallelize_attention(attn: MultiheadAttention, tp: TPGroup, sp: bool, seq_dim: int) -> None:
    """Split a MultiheadAttention by heads (see the module docstring), in place."""
    h, g, d = attn.num_attention_heads, attn.num_gqa_groups, attn.kv_channels
    if attn.attention_type == "self":
        _column_input(getattr(attn, attn._input_proj), tp, sp, seq_dim, (h * d, g * d, g * d))
    else:  # cross: queries from the (sequence-split) hidden states, keys/values from the full encoder output
        _column_input(getattr(attn, attn._input_proj), tp, sp, seq_dim, None)
        to_column_parallel(attn.key_value, tp, sequence_parallel=False, blocks=(g * d, g * d))
    to_row_parallel(attn.proj, tp, sequence_parallel=sp, seq_dim=seq_dim)
    attn.num_attention_heads, attn.num_gqa_groups = h // tp.size, g // tp.size
    core = attn.core_attention
    core.num_attention_heads, core.num_gqa_groups = h // tp.size, g // tp.size
    swap_class(core, ParallelDotProductAttention)
    core.tp = tp


def parallelize_mlp(mlp: LayerNormMLP, tp: TPGroup, sp: bool, seq_dim: int) -> None:
    """Split a LayerNormMLP's FFN features over tp, in place."""
    f = mlp.ffn_hidden_size
    blocks = (f, f) if mlp.activation in GATED else None
    shard_parameter(mlp.fc1_weight, tp, 0, blocks)
    if mlp.fc1_bias is not None:
        shard_parameter(mlp.fc1_bias, tp, 0, blocks)
    shard_parameter(mlp.fc2_weight, tp, 1)
    mlp.ffn_hidden_size = f // tp.size
    swap_class(mlp, ParallelLayerNormMLP)
    _set(mlp, tp, sp, seq_dim)
    _mark_replicated_grads((mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc2_bias), tp, sp)


def parallelize_transformer_layer(layer: TransformerLayer, tp: TPGroup, sequence_parallel: bool) -> None:
    """Make one TransformerLayer tensor parallel in place (call check_transformer_layer first)."""
    seq_dim = seq_dim_of(layer)
    parallelize_attention(layer.self_attention, tp, sequence_parallel, seq_dim)
    if layer.layer_type == "decoder":
        parallelize_attention(layer.inter_attention, tp, sequence_parallel, seq_dim)
    parallelize_mlp(layer.layernorm_mlp, tp, sequence_parallel, seq_dim)
    if layer.output_layernorm:
        _mark_replicated_grads((layer.layernorm.weight, getattr(layer.layernorm, "bias", None)), tp, sequence_parallel)
    swap_class(layer, ParallelTransformerLayer)
    _set(layer, tp, sequence_parallel, seq_dim)


__all__ = [
    "ParallelDotProductAttention", "ParallelLayerNormLinear", "ParallelLayerNormMLP", "ParallelTransformerLayer",
    "check_transformer_layer", "parallelize_attention", "parallelize_mlp", "parallelize_transformer_layer", "seq_dim_of",
]
