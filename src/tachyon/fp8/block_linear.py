"""The FP8 linear layer under block scaling (Float8BlockScaling, MXFP8BlockScaling).

    out = block_fp8_linear(x, weight, bias, scaling, settings, is_first_microbatch)   # x [M, K], weight [N, K]

Every GEMM contracts over blocks of its operands' columns, so each operand is quantized along
the dimension the GEMM that uses it sums over, from high precision (:func:`tachyon.fp8.quantize.
quantize_operand`: one cast, both directions from one read on the GPU):

    forward  out [M, N] = x_q [M, K] @ w_q [N, K].T        x: 1 x 128 along K   w: 128 x 128
    dgrad    dx  [M, K] = g_q [M, N] @ w_qT [K, N].T       g: 1 x 128 along N   w: the same blocks, transposed
    wgrad    dw  [N, K] = g_qT [N, M] @ x_qT [K, M].T      g and x: 1 x 128 along M (128 x 1 blocks of
                                                           g and x, their FP8 data transposed)
    dbias    = grad_out.sum(0) in high precision

(Float8BlockScaling's defaults; ``x_block_scaling_dim`` / ``w_block_scaling_dim`` /
``grad_block_scaling_dim`` = 2 give a role 128 x 128 blocks, whose one quantization serves both
directions; MXFP8 uses 1 x 32 blocks for every role.) An input with a weight that needs a
gradient is therefore quantized twice in the forward, once per direction, as Transformer Engine
does ("both versions are computed from the high precision input to avoid double quantization
errors"), by one kernel that reads it once; the gradient likewise in the backward. Nothing is recorded and no scale is kept: the
recipes are stateless. Saved for backward: x quantized along M (FP8 data [K, M] and its fp32
scales) and the weight quantized for dgrad, or nothing for an operand whose gradient partner
needs none. The GEMMs are :func:`tachyon.fp8.block_gemm.block_gemm` (torch._scaled_mm's
blockwise scaling where it runs, else exact emulation).
"""

from __future__ import annotations

import torch

from tachyon.fp8.context import AutocastSettings, autocast_active
from tachyon.fp8.block_gemm import block_gemm
from tachyon.fp8.checkpoint import GemmCall, note_call, recording, replay_call
from tachyon.fp8.quantize import BlockQuantized, quantize_operand
from tachyon.fp8.scaling import CachedWeight, GemmScaling


def _unpack(q: BlockQuantized | None) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple | None]:
    return (None, None, None) if q is None else (q.data, q.scale_inv, q.block)


class _FP8BlockLinear(torch.autograd.Function):
    """x [M, K] @ weight [N, K].T (+ bias [N]) with block-scaled FP8 operands (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling: GemmScaling, settings: AutocastSettings, is_first_microbatch,
                grad_enabled: bool):
        recipe = settings.recipe
        fp8_dtype, size = recipe.fp8_format.forward_dtype, recipe.block_size
        # a forward without autograd (evaluation) quantizes for its own GEMM only
        need_dx, need_dw = ctx.needs_input_grad[0] and grad_enabled, ctx.needs_input_grad[1] and grad_enabled
        xq, xq_t = quantize_operand(x, fp8_dtype, recipe.block_dim("input"), size, recipe.fp8_quant_fwd_inp,
                                     rows=True, cols=need_dw)
        replay = replay_call(scaling)
        cache = None
        if replay is not None and replay.cached_weight is not None:
            cache = replay.cached_weight
        elif is_first_microbatch is False:
            cache = scaling.cached_weight(weight, fp8_dtype, recipe.name)
        if cache is not None:
            wq, wq_t = cache.data, cache.data_t
        else:
            caching = bool(is_first_microbatch) and replay is None
            wq, wq_t = quantize_operand(weight, fp8_dtype, recipe.block_dim("weight"), size,
                                         recipe.fp8_quant_fwd_weight, rows=True, cols=need_dx or caching)
            if caching:
                scaling.weight_cache = CachedWeight(wq, None, wq_t, recipe.name)
        if recording():
            note_call(scaling, GemmCall(None, None, None, None, cache))
        out = block_gemm(xq, wq, x.dtype)
        if bias is not None:
            out = out + bias
        x_data, x_scale, ctx.x_block = _unpack(xq_t if need_dw else None)
        w_data, w_scale, ctx.w_block = _unpack(wq_t if need_dx else None)
        ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if autocast_active():
            from tachyon.fp8.linear import BACKWARD_INSIDE

            raise RuntimeError(BACKWARD_INSIDE)
        recipe = ctx.recipe
        grad_out = grad_out.contiguous()
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, gq_t = quantize_operand(grad_out, recipe.fp8_format.backward_dtype, recipe.block_dim("grad_output"),
                                     recipe.block_size, recipe.fp8_quant_bwd_grad, rows=need_dx, cols=need_dw)
        dx = dw = db = None
        if need_dx:  # dx [M, K] = g [M, N] @ w [N, K]: w's dgrad form is [K, N], blocks along N
            dx = block_gemm(gq, BlockQuantized(w_data, w_scale, ctx.w_block), ctx.x_dtype)
        if need_dw:  # dw [N, K] = g.T [N, M] @ x [M, K]: both in their forms blocked along M
            dw = block_gemm(gq_t, BlockQuantized(x_data, x_scale, ctx.x_block), ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_out.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: GemmScaling,
                     settings: AutocastSettings, is_first_microbatch: bool | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias under the autocast's block recipe; [M, N] in x's dtype.
    Called by :func:`tachyon.fp8.fp8_linear`, which has checked the arguments."""
    return _FP8BlockLinear.apply(x, weight, bias, scaling, settings, is_first_microbatch, torch.is_grad_enabled())


__all__ = ["block_fp8_linear"]
