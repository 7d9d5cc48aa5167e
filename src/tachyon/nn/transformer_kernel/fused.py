"""The BERT kernel layer's forward and backward as ONE autograd node, for eager calls.

The layer is seven fused ops and three cuBLAS GEMMs (layer.py). Called op by op, each op costs
its Python wrapper, its argument checks and an autograd node in forward and in backward; on a GPU
that host time is longer than the kernels of a BERT-Large layer at seq 128, so the GPU waits.
DeepSpeed's kernel layer is one autograd function for that reason; so is this path: one node
whose forward calls the ops' implementations (the same Triton kernels, or the same PyTorch
references on the torch backend) and whose backward calls their backward implementations, in the
order autograd would, with the same saved tensors. Values are the op-by-op path's, bit for bit
(tests/nn/test_transformer_kernel_fused.py); the op-by-op path stays for torch.compile, dispatch
modes (e.g. TrafficCounter) and functorch transforms, where the ops are traced as custom ops.

The arguments are checked once by the layer (shapes, dtypes, mask, seeds); nothing here checks.
Shapes: x [M, H] (M = batch * seq, contiguous), the key padding bias fp32 [batch, seq] or None,
the three dropout seeds 0-dim int64 tensors, the layer's 12 parameters in _PARAM_NAMES order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from tachyon.kernels.activation.op import _bias_act_fwd
from tachyon.kernels.attention.packed import _packed_bwd, _packed_fwd
from tachyon.kernels.dropout.op import _bda_fwd, _bdan_bwd, _bdan_fwd, _dropout_bwd
from tachyon.kernels.layernorm.op import _norm_bwd, _norm_fwd
from tachyon.kernels.linear.mlp import _gemm_act_grad, _gemm_bias_act
from tachyon.kernels.tiling import deferred_sums

_norm_fwd_impl, _norm_bwd_impl = _norm_fwd.impl, _norm_bwd.impl
_packed_fwd_impl, _packed_bwd_impl = _packed_fwd.impl, _packed_bwd.impl
_bda_fwd_impl, _dropout_bwd_impl = _bda_fwd.impl, _dropout_bwd.impl
_bdan_fwd_impl, _bdan_bwd_impl = _bdan_fwd.impl, _bdan_bwd.impl
_gemm_bias_act_impl, _gemm_act_grad_impl = _gemm_bias_act.impl, _gemm_act_grad.impl
_bias_act_fwd_impl = _bias_act_fwd.impl


class Plan(NamedTuple):
    """What one call of the layer computes, beyond its tensors."""

    batch: int
    seq: int
    heads: int
    pre_ln: bool
    eps: float
    p_attn: float
    p_hidden: float
    sm_scale: float
    deterministic: bool
    invertible: bool
    gelu_checkpoint: bool
    attn_checkpoint: bool
    scale: float  # progressive layer drop: 1 / keep probability on both residual branches (pre-LN)
    backend: str
    mlp_backend: str  # the MLP's GEMM ops: backend, or "cublas" where the dispatch table picks it


def _attention(plan: Plan, x: Tensor, bias: Tensor | None, seed: Tensor, norm_w: Tensor, norm_b: Tensor,
               qkv_w: Tensor, qkv_b: Tensor):
    """[LN_in ->] QKV GEMM -> attention: (y0 (pre-LN) or None, mean0, rstd0, qkv [b, s, 3H], ctx [M, H], lse)."""
    y0 = mean0 = rstd0 = None
    if plan.pre_ln:
        y0, _, mean0, rstd0 = _norm_fwd_impl(x, norm_w, norm_b, None, plan.eps, False, plan.invertible, plan.backend)
        mean0 = None if plan.invertible else mean0  # not stored by the kernel: an empty tensor
        qkv = F.linear(y0, qkv_w)
    else:
        qkv = F.linear(x, qkv_w)
    qkv = qkv.view(plan.batch, plan.seq, qkv.shape[-1])
    ctx, lse, _ = _packed_fwd_impl(qkv, qkv_b, bias, plan.heads, plan.heads, False, False, plan.p_attn, 0, seed,
                                   plan.sm_scale, plan.deterministic, True, None, None, False, plan.backend)
    return y0, mean0, rstd0, qkv, ctx.view(-1, ctx.shape[-1]), lse


def forward(plan: Plan, x: Tensor, bias: Tensor | None, seeds: tuple[Tensor, Tensor, Tensor], params, save: bool):
    """The layer's output [M, H], and (when ``save``) what the backward reads."""
    qkv_w, qkv_b, o_w, o_b, attn_nw, attn_nb, inter_w, inter_b, out_w, out_b, norm_w, norm_b = params
    be, eps, inv, p = plan.backend, plan.eps, plan.invertible, plan.p_hidden
    y0, mean0, rstd0, qkv, ctx, lse = _attention(plan, x, bias, seeds[0], norm_w, norm_b, qkv_w, qkv_b)
    a, ob = F.linear(ctx, o_w), o_b
    if plan.scale != 1.0:
        a, ob = a * plan.scale, o_b * plan.scale
    y1, z1, mean1, rstd1 = _bdan_fwd_impl(a, ob, x, attn_nw, attn_nb, eps, p, 0, seeds[1], False, inv, plan.pre_ln, be)
    pre, act = _gemm_bias_act_impl(y1, inter_w, inter_b, "gelu", plan.mlp_backend)
    f, fb = F.linear(act, out_w), out_b
    if plan.pre_ln:
        if plan.scale != 1.0:
            f, fb = f * plan.scale, out_b * plan.scale
        out = _bda_fwd_impl(f, fb, z1, p, 0, seeds[2], be)
        saved2 = ()
    else:
        out, z2, mean2, rstd2 = _bdan_fwd_impl(f, out_b, y1, norm_w, norm_b, eps, p, 0, seeds[2], False, inv, False,
                                               be)
        saved2 = (out if inv else z2, None if inv else mean2, rstd2)
    if not save:
        return out, None
    if plan.attn_checkpoint:  # the region's input is kept (x); LN_in, the QKV GEMM and attention are rerun
        attention = (None, None, None, None, None)
    elif plan.pre_ln:
        attention = (y0, mean0, rstd0, qkv, lse)
    else:
        attention = (None, None, None, qkv, lse)
    saved1 = (y1 if inv else z1, None if inv else mean1, rstd1)
    return out, (*attention, ctx, *saved1, y1, pre, None if plan.gelu_checkpoint else act, *saved2)


def backward_scaled(plan: Plan, dout: Tensor, x: Tensor, bias: Tensor | None, seeds, params, saved, needs):
    """:func:`backward` with its partial-sum reductions (bias and norm-weight gradients) in one
    launch (tiling.deferred_sums), then progressive layer drop's scale on the two output biases'
    gradients (out_b's in pre-LN only, as the backward scales), which the block must not read
    before it ends."""
    with deferred_sums():
        grads = backward(plan, dout, x, bias, seeds, params, saved, needs)
    if plan.scale != 1.0:
        grads = list(grads)
        grads[4] = grads[4] * plan.scale  # d_o_b
        if plan.pre_ln:
            grads[10] = grads[10] * plan.scale  # d_out_b
        grads = tuple(grads)
    return grads


def backward(plan: Plan, dout: Tensor, x: Tensor, bias: Tensor | None, seeds, params, saved, needs):
    """Gradients of (x, qkv_w, qkv_b, o_w, o_b, attn_nw, attn_nb, inter_w, inter_b, out_w, out_b,
    norm_w, norm_b) from the output's gradient dout [M, H]; ``needs``: ctx.needs_input_grad. With
    progressive layer drop (plan.scale != 1) the gradients of o_b and (pre-LN) out_b are returned
    unscaled: :func:`backward_scaled` scales them."""
    qkv_w, qkv_b, o_w, o_b, attn_nw, attn_nb, inter_w, inter_b, out_w, out_b, norm_w, norm_b = params
    y0, mean0, rstd0, qkv, lse, ctx, saved_n1, mean1, rstd1, y1, pre, act, *saved2 = saved
    be, inv, p, scale = plan.backend, plan.invertible, plan.p_hidden, plan.scale
    d = dout.contiguous()
    # output: bias + dropout + residual (pre-LN) or bias + dropout + residual + LN_out (post-LN)
    if plan.pre_ln:
        if p > 0:
            df, d_out_b = _dropout_bwd_impl(d, p, 0, seeds[2], True, out_b.dtype, be)
        else:
            df, d_out_b = d, d.sum(0, dtype=torch.float32).to(out_b.dtype)
        dz1 = d  # z1 is the residual of the output sum
        if scale != 1.0:  # d_out_b's scale: by the caller, once the block's sums are written (backward_scaled)
            df = df * scale
        d_norm_w = d_norm_b = None
    else:
        saved_n2, mean2, rstd2 = saved2
        df, dres2, d_out_b, d_norm_w, d_norm_b = _bdan_bwd_impl(
            d, saved_n2, None, norm_w, norm_b, rstd2 if mean2 is None else mean2, rstd2, p, 0, seeds[2], False, inv,
            True, out_b.dtype, True, be)
        dz1 = dres2 if p > 0 else df  # the gradient of y1 through the residual branch
    # MLP: Wout GEMM (dW2 from the activation, recomputed under gelu_checkpoint), the dX GEMM with
    # GELU's derivative and b1's gradient in its epilogue, then the Wi GEMMs
    d_out_w = None
    if needs[9]:
        if act is None:
            act = _bias_act_fwd_impl(pre, None, "gelu", be)
        d_out_w = df.t().mm(act)
    dpre, d_inter_b = _gemm_act_grad_impl(df, out_w, pre, "gelu", True, plan.mlp_backend)
    dy1 = dpre.mm(inter_w) if plan.pre_ln else torch.addmm(dz1, dpre, inter_w)
    d_inter_w = dpre.t().mm(y1) if needs[7] else None
    # attention output: bias + dropout + residual + LN_attn; pre-LN: z1's gradient joins (dz_out)
    da, dres1, d_o_b, d_attn_nw, d_attn_nb = _bdan_bwd_impl(
        dy1, saved_n1, dz1 if plan.pre_ln else None, attn_nw, attn_nb, rstd1 if mean1 is None else mean1, rstd1, p,
        0, seeds[1], False, inv, True, o_b.dtype, True, be)
    dres1 = dres1 if p > 0 else da  # the gradient of x through the residual branch
    if scale != 1.0:  # d_o_b's: by the caller (backward_scaled)
        da = da * scale
    if plan.attn_checkpoint:
        with torch.no_grad():
            y0, mean0, rstd0, qkv, _, lse = _attention(plan, x, bias, seeds[0], norm_w, norm_b, qkv_w, qkv_b)
    dctx = da.mm(o_w)
    d_o_w = da.t().mm(ctx) if needs[3] else None
    dqkv, d_qkv_b = _packed_bwd_impl(dctx.view(qkv.shape[0], qkv.shape[1], -1), qkv, qkv_b,
                                     ctx.view(qkv.shape[0], qkv.shape[1], -1), lse, bias, plan.heads, plan.heads, False,
                                     False, plan.p_attn, 0, seeds[0], plan.sm_scale, plan.deterministic, True, None,
                                     None, None, False, be)
    dqkv = dqkv.view(-1, dqkv.shape[-1])
    if plan.pre_ln:
        dy0 = dqkv.mm(qkv_w)
        d_qkv_w = dqkv.t().mm(y0) if needs[1] else None
        saved_n0 = y0 if inv else x
        dx, d_norm_w, d_norm_b = _norm_bwd_impl(dy0, saved_n0, dres1, norm_w, norm_b,
                                                rstd0 if mean0 is None else mean0, rstd0, False, inv, be)
    else:
        dx = torch.addmm(dres1, dqkv, qkv_w)
        d_qkv_w = dqkv.t().mm(x) if needs[1] else None
    return (dx, d_qkv_w, d_qkv_b, d_o_w, d_o_b, d_attn_nw, d_attn_nb, d_inter_w, d_inter_b, d_out_w, d_out_b,
            d_norm_w, d_norm_b)


class KernelLayerFunction(torch.autograd.Function):
    """forward(ctx, plan, x [M, H], bias, seed0, seed1, seed2, *params) -> out [M, H]."""

    @staticmethod
    def forward(ctx, plan: Plan, x: Tensor, bias: Tensor | None, seed0: Tensor, seed1: Tensor, seed2: Tensor,
                *params: Tensor) -> Tensor:
        out, saved = forward(plan, x, bias, (seed0, seed1, seed2), params, True)
        ctx.plan = plan
        # x is read by the backward of LN_in (pre-LN, not invertible), the QKV weight gradient
        # (post-LN) and a recompute (attn_dropout_checkpoint); the op-by-op path keeps it only then too
        keep_x = not plan.pre_ln or not plan.invertible or plan.attn_checkpoint
        ctx.save_for_backward(x if keep_x else None, bias, seed0, seed1, seed2, *params, *saved)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        x, bias, seed0, seed1, seed2, *rest = ctx.saved_tensors
        params, saved = rest[:12], rest[12:]
        needs = ctx.needs_input_grad
        grads = backward_scaled(ctx.plan, dout, x, bias, (seed0, seed1, seed2), params, saved, (needs[1], *needs[6:]))
        return (None, grads[0], None, None, None, None, *grads[1:])


# the C-level apply (torch.autograd.Function.apply adds argument binding and functorch unwrapping,
# which the layer's eager path does not need: it takes this path only without functorch transforms)
apply = super(torch.autograd.Function, KernelLayerFunction).apply

__all__ = ["KernelLayerFunction", "Plan", "apply", "backward", "backward_scaled", "forward"]
