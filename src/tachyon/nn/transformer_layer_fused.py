"""TransformerLayer's forward and backward as ONE autograd node, for eager calls.

The layer's fused path (transformer_layer.py) calls five tachyon ops and four GEMMs through its
submodules (LayerNormLinear, DotProductAttention, Linear, LayerNormMLP): each call costs its
module's Python, its op's argument checks, backend choice and autograd node, in forward and in
backward. On a GPU that host time is longer than the kernels of a layer at the shapes layers are
trained at, so the GPU waits (docs/host_time.md). This path runs the same layer as one
``autograd.Function`` whose forward calls the same ops' implementations (the same Triton
kernels, or the same PyTorch references on the torch backend) with the same arguments, and whose
backward calls their backward implementations and the same GEMMs autograd would run
(``grad.mm(W)`` for the input, ``grad.t().mm(input)`` for the weight). Values are the module
path's, bit for bit, and the same tensors are saved (tests/nn/test_transformer_layer_fused.py).

It runs where the module path would run exactly these ops: an encoder layer, pre-LN
(``output_layernorm=False``, ``apply_residual_connection_post_layernorm=False``), progressive layer
drop or not (its 1 / p on both residual branches, as the module path), RoPE with one table for queries and keys (then, as on the module path, the QKV GEMM
adds its bias and the attention op rotates q and k) or none, any self-attention mask type
("causal", "no_mask", "padding", "padding_causal" with TE's [b, 1, 1, s] mask or a (query, key)
pair; padded query rows of the context zeroed, as the module path does), no FP8 (outside an enabled
``fp8_autocast``, GEMMs that never ran in FP8), zero-centered gamma or not (the same for every
norm), the params' dtype (or
torch.autocast's, to which run() casts them first as the module path casts them), the Triton kernel for the input norm (not its torch twin, which ``backend="auto"``
picks on CUDA where measured faster), the modules' own classes without hooks or replaced
forwards, plain tensors outside torch.compile / dispatch modes / functorch. Anything else takes
the module path, which stays what torch.compile traces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as _module

from tachyon.backend import auto_on_cuda, resolve
from tachyon.fp8.linear import runs_high_precision
from tachyon.kernels import dispatch
from tachyon.kernels.attention.op import MAX_TRITON_HEAD_DIM
from tachyon.kernels.attention.reference import default_scale, masked_bias
from tachyon.kernels.common import SUPPORTED_DTYPES
from tachyon.kernels.dropout.op import MAX_TRITON_N as MAX_BDAN_N
from tachyon.kernels.dropout.op import _bda_fwd, _bdan_bwd, _bdan_fwd, _dropout_bwd
from tachyon.kernels.layernorm.op import MAX_TRITON_N as MAX_NORM_N
from tachyon.kernels.layernorm.op import _norm_bwd, _norm_fwd, _twin_applies
from tachyon.kernels.linear.mlp import _gemm_act_grad, _gemm_bias_act, gemm_backend
from tachyon.kernels.attention.packed import _packed_bwd, _packed_fwd
from tachyon.kernels.registry import eager_call
from tachyon.kernels.tiling import deferred_sums
from tachyon.nn.attention import ATTN_MASK_TYPES, DotProductAttention, MultiheadAttention
from tachyon.nn.layernorm_linear import LayerNormLinear, norm_weight
from tachyon.nn.layernorm_mlp import _KERNEL_NAME, LayerNormMLP
from tachyon.nn.linear import Linear, compute_dtype
from tachyon.nn.rope import rotary_tables

_is_compiling = torch.compiler.is_compiling
_norm_fwd_impl, _norm_bwd_impl = _norm_fwd.impl, _norm_bwd.impl
_packed_fwd_impl, _packed_bwd_impl = _packed_fwd.impl, _packed_bwd.impl
_bda_fwd_impl, _dropout_bwd_impl = _bda_fwd.impl, _dropout_bwd.impl
_bdan_fwd_impl, _bdan_bwd_impl = _bdan_fwd.impl, _bdan_bwd.impl
_gemm_bias_act_impl, _gemm_act_grad_impl = _gemm_bias_act.impl, _gemm_act_grad.impl


class Plan(NamedTuple):
    """What one call computes, beyond its tensors."""

    shape: tuple[int, ...]  # the input's [s, b, h] / [b, s, h]
    rms: bool
    eps1: float  # the input norm's (layernorm_qkv.eps)
    eps2: float  # the MLP norm's (layernorm_mlp.eps)
    heads: int
    kv_heads: int
    sbhd: bool
    causal: bool
    p_attn: float
    p_hidden: float
    softmax_scale: float
    one_kernel: bool
    activation: str  # the fused MLP kernel's activation name
    be_norm: str  # backends: the input norm, attention, the MLP block's norm + dropout, the MLP, the output add
    be_attn: str
    be_bdan: str
    be_mlp: str
    be_bda: str
    norm_twin: bool  # the input LayerNorm runs as torch's op (backend "auto" on CUDA, tachyon.kernels.dispatch)
    rope_cos: Tensor | None  # RoPE tables fp32 [seq, rotary_dim] on x's device (None: no RoPE)
    rope_sin: Tensor | None
    rope_interleaved: bool
    pad_bias: Tensor | None  # padding masks: the key padding bias fp32 [b, s] (-inf where padded), as the op takes it
    q_masked: Tensor | None  # and the padded queries, bool [s, b, 1] (sbhd) / [b, s, 1]: their context rows are 0
    cast: bool  # the parameters are cast to x's dtype first (torch.autocast), as the module path casts them
    zero_centered: bool  # the norms' weights are 1 + gamma in fp32 (zero_centered_gamma), as the module path forms them
    scale: float  # progressive layer drop's 1 / p on both residual branches (1.0: none)


def _plain_module(module: torch.nn.Module, cls: type) -> bool:
    """``module`` is exactly ``cls``, without hooks or a forward replaced on the instance: calling
    it runs ``cls.forward`` and nothing else."""
    return (type(module) is cls and not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                                         or module._backward_pre_hooks) and "forward" not in module.__dict__)


def plan_for(layer, x: Tensor, attention_mask, self_attn_mask_type, rotary_pos_emb, encoder_output,
             is_first_microbatch, scale: float) -> Plan | None:
    """The Plan of one call of ``layer`` (exactly a TransformerLayer, not a subclass: the caller
    checks; its input x already in the compute dtype), or None where the module path must run
    (module docstring)."""
    if _is_compiling():  # first: torch.compile traces the module path and nothing of the checks below
        return None
    if (layer.layer_type != "encoder" or layer.output_layernorm
            or layer.apply_residual_connection_post_layernorm
            or encoder_output is not None):
        return None
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        return None  # the module path raises
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks):
        return None
    attn, mlp = layer.self_attention, layer.layernorm_mlp
    if not (_plain_module(attn, MultiheadAttention) and _plain_module(mlp, LayerNormMLP)):
        return None
    training = layer.training
    qkv, core, proj = getattr(attn, "layernorm_qkv", None), attn.core_attention, attn.proj
    if not (attn.input_layernorm and _plain_module(qkv, LayerNormLinear) and _plain_module(core, DotProductAttention)
            and _plain_module(proj, Linear) and attn.attention_type == "self" and attn.return_bias
            and proj.return_bias and not attn.return_layernorm_output and not qkv.return_layernorm_output
            and not mlp.return_layernorm_output and mlp.return_bias
            and qkv.zero_centered_gamma == mlp.zero_centered_gamma == layer.zero_centered_gamma
            and core.training == training):
        return None
    mask_type = core.attn_mask_type if self_attn_mask_type is None else self_attn_mask_type
    if mask_type not in ATTN_MASK_TYPES:
        return None  # the module path refuses it
    activation = _KERNEL_NAME.get(mlp.activation)
    if activation is None or qkv.normalization != mlp.normalization or qkv.normalization != layer.normalization:
        return None
    if not runs_high_precision(qkv.fp8_scaling["gemm"], proj.fp8_scaling["gemm"], mlp.fp8_scaling["fc1"],
                               mlp.fp8_scaling["fc2"]):
        return None
    dtype = x.dtype
    if dtype not in SUPPORTED_DTYPES:
        return None  # the module path refuses it
    params = _params(layer)
    if not eager_call((x, *params)):
        return None
    n = x.shape[-1]
    # parameters in another dtype: under torch.autocast the module path casts each to the autocast
    # dtype (``.to``, one graph node each); run() does the same casts, then the one node
    cast = False
    for p in params:
        if p is not None and (p.dtype != dtype or p.device != x.device):
            if p.device != x.device or not p.is_floating_point() or compute_dtype(p, x) != dtype:
                return None  # the module path's checks and errors
            cast = True
    rms = qkv.normalization == "RMSNorm"
    ln_w, ln_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b = params
    h, g, d = core.num_attention_heads, core.num_gqa_groups, core.kv_channels
    width = (h + 2 * g) * d
    if (ln_w.shape != (n,) or (ln_b is not None and ln_b.shape != (n,)) or qkv_w.shape != (width, n)
            or (qkv_b is not None and qkv_b.shape != (width,)) or proj_w.shape != (n, h * d)
            or (proj_b is not None and proj_b.shape != (n,)) or ln2_w.shape != (n,)
            or (ln2_b is not None and ln2_b.shape != (n,)) or (rms != (ln_b is None)) or (rms != (ln2_b is None))
            or fc1_w.dim() != 2 or fc1_w.shape[1] != n or fc2_w.dim() != 2 or fc2_w.shape[0] != n
            or (fc1_b is not None and fc1_b.shape != (fc1_w.shape[0],)) or (fc2_b is not None and fc2_b.shape != (n,))
            or (qkv_b is None) != (proj_b is None)):
        return None  # what the module path's checks refuse (or a layout it would handle otherwise)
    be_norm, be_attn, be_bdan = resolve(x, qkv.backend), resolve(x, core.backend), resolve(x, layer.backend)
    if (be_norm == "triton" and n > MAX_NORM_N) or (be_bdan == "triton" and n > MAX_BDAN_N) or (
            be_attn == "triton" and d > MAX_TRITON_HEAD_DIM):
        return None  # the module path raises
    causal, pad_bias, q_masked = mask_type == "causal", None, None
    if mask_type.startswith("padding") or attention_mask is not None:  # as the module path's attention reads it
        seq, batch = (x.shape[0], x.shape[1]) if core.qkv_format == "sbhd" else (x.shape[1], x.shape[0])
        try:
            causal, pad_bias, q_masked = core._mask_args(attention_mask, mask_type, batch, seq, seq, x.device)
        except ValueError:
            return None  # the module path raises
        pad_bias = masked_bias(pad_bias)
        q_masked = (q_masked.t() if core.qkv_format == "sbhd" else q_masked)[:, :, None]  # against the context
    cos = sin = None
    if rotary_pos_emb is not None:  # the module path's packed RoPE: one table for q and k, checked as it checks
        try:
            q_tab, k_tab = rotary_tables(rotary_pos_emb, x.shape[0 if core.qkv_format == "sbhd" else 1])
        except ValueError:
            return None  # the module path raises
        r = q_tab.cos.shape[1]
        if k_tab is not q_tab or r == 0 or r % 2 or r > d:
            return None  # separate query and key angles (the module path's unpacked RoPE), or its error
        cos, sin = q_tab.cos.to(x.device), q_tab.sin.to(x.device)
    zero_centered = bool(layer.zero_centered_gamma)
    if zero_centered or cast:  # the weights the module path hands the norms: fp32 1 + gamma, or cast to dtype
        twin_ok = (torch.float32 if zero_centered else dtype) == dtype
    else:
        twin_ok = _twin_applies(x, ln_w, ln_b, None)
    norm_twin = be_norm == "triton" and auto_on_cuda(x, qkv.backend) and twin_ok and (
        dispatch.choose_by("rms_norm" if rms else "layer_norm", x, dispatch.norm_class, (n,),
                           dispatch.needs_backward(x, ln_w, ln_b)) == dispatch.TWIN)
    if norm_twin and (rms or cast):
        return None  # torch's RMSNorm there, or torch's norm under autocast (its fp32 policy): the module path
    return Plan(
        tuple(x.shape), rms, float(qkv.eps), float(mlp.eps), h, g, core.qkv_format == "sbhd", causal,
        float(core.attention_dropout) if training else 0.0, float(layer.hidden_dropout) if training else 0.0,
        default_scale(d, core.softmax_scale), core.one_kernel_backward, activation, be_norm, be_attn, be_bdan,
        gemm_backend(x, mlp.backend, fc2_w.shape[1], *params), be_bdan, norm_twin, cos, sin,
        attn.rotary_pos_interleaved, pad_bias, q_masked, cast, zero_centered, float(scale),
    )


_NORM_WEIGHTS = (0, 6)  # positions of the two norms' weights in _params


def _params(layer) -> tuple[Tensor | None, ...]:
    """The layer's 12 parameters in the order forward and backward take them."""
    qkv = layer.self_attention.layernorm_qkv
    proj = layer.self_attention.proj
    mlp = layer.layernorm_mlp
    q, o, m = qkv._parameters, proj._parameters, mlp._parameters
    return (q["layer_norm_weight"], q["layer_norm_bias"], q["weight"], q["bias"], o["weight"], o["bias"],
            m["layer_norm_weight"], m["layer_norm_bias"], m["fc1_weight"], m["fc1_bias"], m["fc2_weight"],
            m["fc2_bias"])


def forward(plan: Plan, x: Tensor, seeds, params, save: bool):
    """The layer's output (x's shape) and, when ``save``, what the backward reads."""
    ln_w, ln_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b = params
    s_attn, s1, s2 = seeds
    shape, n = plan.shape, plan.shape[-1]
    x2 = x.reshape(-1, n)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    # input norm (its input also feeds the residual: the norm's backward adds that gradient), or
    # torch's LayerNorm where backend "auto" picks it (as layer_norm's torch twin: on x as given)
    if plan.norm_twin:
        y0, mean0, rstd0 = torch.native_layer_norm(x, (n,), ln_w, ln_b, plan.eps1)
        y0 = y0.view(-1, n)
    else:
        y0, _, mean0, rstd0 = _norm_fwd_impl(x2, ln_w, ln_b, None, plan.eps1, plan.rms, False, plan.be_norm)
    rope = plan.rope_cos is not None
    if rope:  # as the module path: the GEMM adds the bias, the attention op rotates q and k (kept: qk_rot)
        qkv = F.linear(y0, qkv_w, qkv_b).view(shape[0], shape[1], -1)
        ctx, lse, qk_rot = _packed_fwd_impl(qkv, None, plan.pad_bias, plan.heads, plan.kv_heads, plan.sbhd, plan.causal,
                                            plan.p_attn, 0, s_attn, plan.softmax_scale, True, plan.one_kernel,
                                            plan.rope_cos, plan.rope_sin, plan.rope_interleaved, plan.be_attn)
    else:
        qkv = F.linear(y0, qkv_w).view(shape[0], shape[1], -1)  # the bias is added by the attention kernels
        ctx, lse, _ = _packed_fwd_impl(qkv, qkv_b, plan.pad_bias, plan.heads, plan.kv_heads, plan.sbhd, plan.causal,
                                       plan.p_attn, 0, s_attn, plan.softmax_scale, True, plan.one_kernel, None, None,
                                       False, plan.be_attn)
        qk_rot = None
    # padded queries: their context rows set to 0 before the projection (the module path's masked_fill)
    ctx_in = ctx if plan.q_masked is None else ctx.masked_fill(plan.q_masked, 0.0)
    ctx2 = ctx_in.view(-1, ctx.shape[-1])
    a = F.linear(ctx2, proj_w)
    scale = plan.scale
    if scale != 1.0:  # progressive layer drop: a kept layer's residual branches over p, as the module path's _bda
        a, proj_b = a * scale, (proj_b * scale if proj_b is not None else None)
    # h = x + dropout(a + proj_b), y1 = norm2(h): one kernel
    y1, z1, mean1, rstd1 = _bdan_fwd_impl(a, proj_b, x2, ln2_w, ln2_b, plan.eps2, plan.p_hidden, 0, s1, plan.rms, False,
                                          True, plan.be_bdan)
    pre, act = _gemm_bias_act_impl(y1, fc1_w, fc1_b, plan.activation, plan.be_mlp)
    f = F.linear(act, fc2_w)
    if scale != 1.0:
        f, fc2_b = f * scale, (fc2_b * scale if fc2_b is not None else None)
    out = _bda_fwd_impl(f, fc2_b, z1, plan.p_hidden, 0, s2, plan.be_bda)
    if not save:
        return out.view(*shape), None
    mean0 = None if plan.rms else mean0
    mean1 = None if plan.rms else mean1
    # the RoPE tables, the padding bias and mask as the module path's ops save them (the plan holds them too)
    return out.view(*shape), (x if plan.norm_twin else x2, mean0, rstd0, y0, qkv, ctx, lse, qk_rot, plan.rope_cos,
                              plan.rope_sin, plan.pad_bias, plan.q_masked, None if ctx_in is ctx else ctx_in, z1,
                              mean1, rstd1, y1, pre, act)


def backward(plan: Plan, dout: Tensor, seeds, params, saved, needs, biases):
    """Gradients of (x, *params) from the output's gradient; ``needs``: which inputs want one
    (ctx.needs_input_grad without the plan and the seeds). The backward does not read proj_b,
    fc1_b and fc2_b (None in ``params``; not saved, as on the module path): ``biases`` says
    (proj_b's dtype or None, whether fc1_b exists, fc2_b's dtype or None). With progressive layer
    drop the gradients of proj_b and fc2_b are returned without its scale (the caller applies it
    once the deferred reductions have written them)."""
    ln_w, ln_b, qkv_w, qkv_b, proj_w, _, ln2_w, ln2_b, fc1_w, _, fc2_w, _ = params
    proj_bd, has_fc1_b, fc2_bd = biases
    (x2, mean0, rstd0, y0, qkv, ctx, lse, qk_rot, rope_cos, rope_sin, pad_bias, q_masked, ctx_in, z1, mean1, rstd1, y1,
     pre, act) = saved
    s_attn, s1, s2 = seeds
    p = plan.p_hidden
    d = dout.reshape(-1, dout.shape[-1])
    if not d.is_contiguous():
        d = d.contiguous()
    # out = z1 + dropout(f + fc2_b): z1's gradient is d itself
    if p > 0:
        df, d_fc2_b = _dropout_bwd_impl(d, p, 0, s2, fc2_bd is not None, fc2_bd or d.dtype, plan.be_bda)
        d_fc2_b = d_fc2_b if fc2_bd is not None else None
    else:
        df, d_fc2_b = d, (d.sum(0, dtype=torch.float32).to(fc2_bd) if fc2_bd is not None else None)
    if plan.scale != 1.0:  # progressive layer drop (d_fc2_b's scale: after the reductions, by the caller)
        df = df * plan.scale
    # MLP: dW2, then the dX GEMM with the activation's derivative (and fc1_b's gradient) in its epilogue
    d_fc2_w = df.t().mm(act) if needs[11] else None
    dpre, d_fc1_b = _gemm_act_grad_impl(df, fc2_w, pre, plan.activation, has_fc1_b, plan.be_mlp)
    dy1 = dpre.mm(fc1_w)
    d_fc1_w = dpre.t().mm(y1) if needs[9] else None
    # h = x + dropout(a + proj_b), y1 = norm2(h); z1 (= h) also took d through the output's residual
    da, dres, d_proj_b, d_ln2_w, d_ln2_b = _bdan_bwd_impl(
        dy1, z1, d, ln2_w, ln2_b, rstd1 if mean1 is None else mean1, rstd1, p, 0, s1, plan.rms, False,
        proj_bd is not None, proj_bd or dy1.dtype, True, plan.be_bdan)
    dx_branch = dres if p > 0 else da
    if plan.scale != 1.0:  # (d_proj_b's: by the caller)
        da = da * plan.scale
    dctx = da.mm(proj_w)
    ctx_in = ctx if ctx_in is None else ctx_in  # the projection's input (padded query rows zeroed)
    d_proj_w = da.t().mm(ctx_in.view(-1, ctx.shape[-1])) if needs[5] else None
    if q_masked is not None:  # masked_fill's backward
        dctx = dctx.view(*ctx.shape).masked_fill(q_masked, 0.0)
    rope = plan.rope_cos is not None
    dqkv, d_qkv_b = _packed_bwd_impl(dctx.view(*ctx.shape), qkv, None if rope else qkv_b, ctx, lse, pad_bias, plan.heads,
                                     plan.kv_heads, plan.sbhd, plan.causal, plan.p_attn, 0, s_attn, plan.softmax_scale,
                                     True, plan.one_kernel, qk_rot, rope_cos, rope_sin, plan.rope_interleaved,
                                     plan.be_attn)
    dqkv2 = dqkv.view(-1, dqkv.shape[-1])
    if rope and qkv_b is not None:  # the GEMM's bias, as autograd sums a broadcast bias's gradient
        d_qkv_b = dqkv2.sum(0)
    dy0 = dqkv2.mm(qkv_w)
    d_qkv_w = dqkv2.t().mm(y0) if needs[3] else None
    if plan.norm_twin:  # x's two gradients summed as autograd sums them
        dx, d_ln_w, d_ln_b = torch.ops.aten.native_layer_norm_backward(
            dy0.view(*plan.shape), x2, (plan.shape[-1],), mean0, rstd0, ln_w, ln_b, [needs[0], True, ln_b is not None])
        dx = dx + dx_branch.view(*plan.shape) if needs[0] else None
    else:
        dx, d_ln_w, d_ln_b = _norm_bwd_impl(dy0, x2, dx_branch, ln_w, ln_b, rstd0 if mean0 is None else mean0, rstd0,
                                            plan.rms, False, plan.be_norm)
    return (dx.view(*plan.shape) if needs[0] else None, d_ln_w, d_ln_b if ln_b is not None else None, d_qkv_w,
            d_qkv_b if qkv_b is not None else None, d_proj_w, d_proj_b if proj_bd is not None else None, d_ln2_w,
            d_ln2_b if ln2_b is not None else None, d_fc1_w, d_fc1_b if has_fc1_b else None, d_fc2_w, d_fc2_b)


class TransformerLayerFunction(torch.autograd.Function):
    """forward(ctx, plan, x, seed_attn, seed1, seed2, *params) -> out (x's shape)."""

    @staticmethod
    def forward(ctx, plan: Plan, x: Tensor, s_attn, s1, s2, *params):
        out, saved = forward(plan, x, (s_attn, s1, s2), params, True)
        ctx.plan = plan
        proj_b, fc1_b, fc2_b = params[5], params[9], params[11]  # read for their dtypes only
        ctx.biases = (proj_b.dtype if proj_b is not None else None, fc1_b is not None,
                      fc2_b.dtype if fc2_b is not None else None)
        kept = (*params[:5], None, *params[6:9], None, params[10], None)
        ctx.save_for_backward(s_attn, s1, s2, *kept, *saved)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        s_attn, s1, s2, *rest = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # the five partial-sum reductions (bias and norm-weight gradients, only returned) in one launch
        with deferred_sums():
            grads = backward(ctx.plan, dout, (s_attn, s1, s2), rest[:12], rest[12:], (needs[1], *needs[5:]),
                             ctx.biases)
        scale = ctx.plan.scale
        if scale != 1.0:  # progressive layer drop on the two branch biases' gradients, now that they are summed
            grads = list(grads)
            for i in (6, 12):  # d_proj_b, d_fc2_b
                grads[i] = grads[i] * scale if grads[i] is not None else None
        return (None, grads[0], None, None, None, *grads[1:])


# the C-level apply (Function.apply adds argument binding and functorch unwrapping, which this path,
# taken only without functorch transforms, does not need)
_apply = super(torch.autograd.Function, TransformerLayerFunction).apply


def run(layer, plan: Plan, x: Tensor, seeds) -> Tensor:
    """The layer's output through one autograd node (or, without a gradient to compute, the same
    forward without saving)."""
    params = _params(layer)
    if plan.cast or plan.zero_centered:  # what the module path hands its ops, as graph nodes: each parameter
        # .to(compute dtype) (torch.autocast; a no-op otherwise), the norm weights 1 + gamma in fp32
        # (zero-centered, from the parameter itself: norm_weight)
        dtype, zc = x.dtype, plan.zero_centered
        params = tuple(norm_weight(p, True, dtype) if zc and i in _NORM_WEIGHTS else (p.to(dtype) if p is not None else None)
                       for i, p in enumerate(params))
    s_attn = seeds[0] if plan.p_attn > 0 else None
    s1, s2 = (seeds[1], seeds[2]) if plan.p_hidden > 0 else (None, None)
    if torch.is_grad_enabled() and (x.requires_grad or any(p is not None and p.requires_grad for p in params)):
        return _apply(plan, x, s_attn, s1, s2, *params)
    return forward(plan, x, (s_attn, s1, s2), params, False)[0]


__all__ = ["Plan", "TransformerLayerFunction", "backward", "forward", "plan_for", "run"]
