"""``fp8_linear``: the linear layer every FP8-capable module calls, and the module mixin that keeps
each GEMM's scaling state in the module's state_dict.

    out = fp8_linear(x, weight, bias, scaling)      # x [..., K], weight [N, K], bias [N] or None

Outside an autocast this is ``F.linear`` in the inputs' dtype. Inside one (enabled), the GEMM
runs in FP8 under the autocast's recipe. Per-tensor recipes (delayed and current scaling):

    forward   x8 = fp8(x * s_x), w8 = fp8(w * s_w)       E4M3
              out = (x8 @ w8.T) * (1/s_x) * (1/s_w) + bias
    backward  g8 = fp8(grad_out * s_g)                   E5M2 (HYBRID) or E4M3
              dgrad  dx = (g8 @ w8) / (s_g s_w)
              wgrad  dw = (g8.T @ x8) / (s_g s_x)
              dbias  = grad_out.sum(0) in high precision

with s the delayed scale of ``scaling`` (a :class:`GemmScaling`) or, under Float8CurrentScaling,
the tensor's own (its amax read in one reduction, then the cast). Block recipes run the same
three GEMMs on block-scaled operands (:mod:`tachyon.fp8.block_linear`).

Delayed scaling: each cast records its operand's amax in the same pass (tachyon.fp8.cast_to_fp8:
one fused Triton kernel on GPUs); the grad_output scales of all the FP8 GEMMs a backward pass ran
are updated together when that pass ends, the input and weight scales when the outermost
autocast exits (:mod:`tachyon.fp8.pending`). In calibration (``autocast(enabled=False,
calibrating=True)``, delayed scaling only) the same three amaxes are recorded but every GEMM runs
in high precision.

Saved for backward: x8 and w8 (FP8, a quarter of fp32's memory) and the two scale_inv values used
in the forward (copies, so a later scale update cannot change this step's gradients). Where
torch._scaled_mm runs, the casts also write x8.T and w8.T contiguous (the layouts the dgrad/wgrad
GEMMs take) and those are saved instead, so the backward makes no transposing copies; the
gradient's cast writes g8.T in the same pass when wgrad is needed.

FP8 weight caching (``is_first_microbatch``, Transformer Engine's argument). With gradient
accumulation the weights do not change between the micro-batches of a step, so their FP8 cast
need not be repeated:

    None    no caching: the weight is cast (and its amax recorded) on every call
    True    first micro-batch: cast and record as usual, and keep the FP8 weight and the
            scale_inv it was cast with (block recipes: both quantized forms) in
            ``scaling.weight_cache``
    False   a later micro-batch: use the cached weight; no weight cast, no weight amax recorded
            (ValueError when nothing fitting is cached, or it was cast under another recipe)

Only FP8 runs are affected: outside an autocast and in calibration the argument is ignored.
The weight's delayed state still takes part in every scale update, as in Transformer Engine:
over a step of n micro-batches its amax history gets one record (the first micro-batch's) and is
rolled n times. The cached weight stays consistent whatever the scale updates do in between; the
caller guarantees that the weights did not change since the True call (the optimizer steps after
the last micro-batch). Inside an activation-checkpointed region the recomputation repeats exactly
what the forward did (:mod:`tachyon.fp8.checkpoint`).
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F

from tachyon.fp8 import pending
from tachyon.fp8.context import AutocastSettings, autocast_active, current_settings, recomputing, register_forward
from tachyon.fp8.checkpoint import GemmCall, note_call, recording, replay_call
from tachyon.fp8.gemm import cast_to_fp8, check_fp8_dims, fp8_gemm, native_fp8_supported
from tachyon.fp8.quantize import current_scale
from tachyon.fp8.scaling import CachedWeight, GemmScaling

BACKWARD_INSIDE = (
    "backward was called inside an FP8 autocast; call backward outside fp8_autocast / tachyon.autocast "
    "(the context wraps the forward only: the forward's scales are updated when it exits)"
)


RECOMPUTE_OUTSIDE = (
    "an FP8 GEMM that ran in FP8 is being recomputed during backward outside an FP8 autocast, which "
    "would give high-precision activations for an FP8 forward: an activation checkpoint that "
    "cannot restore the autocast (torch.utils.checkpoint with use_reentrant=True, or with "
    "use_reentrant=False but no context_fn). Use tachyon.checkpointing.checkpoint, or "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False, "
    "context_fn=tachyon.fp8.fp8_checkpoint_context_fn())"
)


def fast_accum(recipe, gemm: str) -> bool:
    """torch._scaled_mm's use_fast_accum for GEMM ``gemm`` ("fprop", "dgrad", "wgrad") of
    ``recipe``: not its MMParams' use_split_accumulator (delayed scaling: False)."""
    params = getattr(recipe, f"fp8_gemm_{gemm}", None)
    return params is not None and not params.use_split_accumulator


class _FP8Linear(torch.autograd.Function):
    """x [M, K] @ weight[N, K].T (+ bias [N]) with per-tensor FP8 numerics (delayed or current
    scaling) or amax recording (calibration)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling: GemmScaling, settings: AutocastSettings, is_first_microbatch):
        recipe = settings.recipe
        delayed = recipe.stateful
        if delayed:
            scaling.prepare(recipe.amax_history_len, x.device)
        record = delayed and not recomputing()  # a recomputation records nothing: the forward did
        ctx.transposed = False
        if settings.fp8:
            # the casts record the amaxes in the same pass (a reused cached weight records none)
            ctx.transposed = transposed_operands(x.device)
            x8, w8, sx, sw, x8_t, w8_t = _cast_operands(
                x, weight, scaling, recipe, is_first_microbatch, record, ctx.transposed)
            out = fp8_gemm(x8, sx, w8, sw, x.dtype, use_fast_accum=fast_accum(recipe, "fprop"))
            if ctx.transposed:  # the backward GEMMs take these without a transposing copy
                ctx.save_for_backward(x8_t, w8_t, sx, sw)
            else:
                ctx.save_for_backward(x8, w8, sx, sw)
        else:
            if record:
                scaling.input.record(x)
                scaling.weight.record(weight)
            out = x @ weight.t()
            ctx.save_for_backward(x, weight)
        if bias is not None:
            out = out + bias
        if delayed:
            register_forward(scaling, settings)
        ctx.scaling, ctx.settings = scaling, settings
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if autocast_active():
            raise RuntimeError(BACKWARD_INSIDE)
        settings, state = ctx.settings, ctx.scaling.grad_output
        recipe = settings.recipe
        delayed = recipe.stateful
        grad_out = grad_out.contiguous()
        if delayed:
            state.prepare(recipe.amax_history_len, grad_out.device)
        dx = dw = None
        if settings.fp8:
            x8, w8, sx, sw = ctx.saved_tensors  # x8_t [K, M], w8_t [K, N] when ctx.transposed
            want_t = ctx.transposed and ctx.needs_input_grad[1]
            if delayed:  # the update at the end of the backward pass changes scale_inv after these GEMMs
                g_scale, sg, amax = state.scale, state.scale_inv, state.amax_history[0]
            else:
                (g_scale, sg), amax = current_scale(grad_out, recipe.backward_max, recipe.fp8_quant_bwd_grad), None
            cast = cast_to_fp8(grad_out, g_scale, recipe.fp8_format.backward_dtype, amax, transpose=want_t)
            g8, g8_t = cast if want_t else (cast, None)
            if ctx.needs_input_grad[0]:  # dx [M, K] = g8 [M, N] @ w8 [N, K]
                dx = fp8_gemm(g8, sg, w8 if ctx.transposed else w8.t(), sw, ctx.x_dtype,
                              use_fast_accum=fast_accum(recipe, "dgrad"))
            if ctx.needs_input_grad[1]:  # dw [N, K] = g8.T [N, M] @ x8 [M, K]
                wgrad_fast = fast_accum(recipe, "wgrad")
                dw = (fp8_gemm(g8_t, sg, x8, sx, ctx.w_dtype, use_fast_accum=wgrad_fast) if ctx.transposed
                      else fp8_gemm(g8.t(), sg, x8.t(), sx, ctx.w_dtype, use_fast_accum=wgrad_fast))
        else:
            state.record(grad_out)
            x, weight = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                dx = grad_out @ weight
            if ctx.needs_input_grad[1]:
                dw = grad_out.t() @ x
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_out.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if delayed:
            pending.mark_backward(state, recipe, settings.group, grad_out.device)
        return dx, dw, db, None, None, None


def transposed_operands(device: torch.device) -> bool:
    """Whether the FP8 casts also write the transposed copies the backward GEMMs take (where
    torch._scaled_mm runs: it wants a row-major first and a column-major second operand, so the
    emulation, which takes any layout, skips them)."""
    return native_fp8_supported(device)


def _cast(x, scale, fp8_dtype, amax, transpose: bool):
    out = cast_to_fp8(x, scale, fp8_dtype, amax, transpose=transpose)
    return out if transpose else (out, None)


def _live_scales(state, tensor, recipe, qparams):
    """(scale, scale_inv copy) a delayed GEMM casts with now, or the tensor's current scaling
    (scale_inv not copied: nothing updates it later)."""
    if recipe.stateful:
        return state.scale, state.scale_inv.clone()
    return current_scale(tensor, recipe.forward_max, qparams)


def _cast_operands(x, weight, scaling: GemmScaling, recipe, is_first_microbatch: bool | None, record: bool,
                   transpose: bool):
    """(x8, w8, x scale_inv, w scale_inv, x8_t, w8_t) for a per-tensor FP8 GEMM: the live (delayed)
    or the operands' own (current) scales, or in a checkpointed region's recomputation the ones
    its forward used; the weight from the cache when asked. Each delayed cast records its
    operand's amax when ``record`` (not for a cached weight). The transposed copies are None
    unless ``transpose``."""
    fp8_dtype = recipe.fp8_format.forward_dtype
    replay = replay_call(scaling)
    if replay is None:
        x_scale, sx = _live_scales(scaling.input, x, recipe, getattr(recipe, "fp8_quant_fwd_inp", None))
    else:
        x_scale, sx = replay.input_scale, replay.input_scale_inv
    x8, x8_t = _cast(x, x_scale, fp8_dtype, scaling.input.amax_history[0] if record else None, transpose)
    w_scale = cached = w8_t = None
    if replay is not None and replay.cached_weight is not None:
        cached, sw = replay.cached_weight, replay.weight_scale_inv
        w8 = cached
    elif is_first_microbatch is False:
        cache = scaling.cached_weight(weight, fp8_dtype, recipe.name)
        cached, sw, w8_t = cache.data, cache.scale_inv, cache.data_t
        w8 = cached
    else:
        if replay is None:
            w_scale, sw = _live_scales(scaling.weight, weight, recipe, getattr(recipe, "fp8_quant_fwd_weight", None))
        else:
            w_scale, sw = replay.weight_scale, replay.weight_scale_inv
        w8, w8_t = _cast(weight, w_scale, fp8_dtype, scaling.weight.amax_history[0] if record else None, transpose)
        if is_first_microbatch and replay is None:
            scaling.weight_cache = CachedWeight(w8, sw, w8_t, recipe.name)
    if transpose and w8_t is None:
        w8_t = w8.t().contiguous()
    if recording():
        copy = recipe.stateful  # a delayed scale is updated in place later: remember its value
        note_call(scaling, GemmCall(x_scale.clone() if copy else x_scale, sx,
                                    None if w_scale is None else (w_scale.clone() if copy else w_scale), sw, cached))
    return x8, w8, sx, sw, x8_t, w8_t


def runs_high_precision(*scalings: GemmScaling) -> bool:
    """True where these GEMMs run as plain GEMMs now, so a module may run them fused with what
    sits beside them (LayerNormMLP: the activation in the GEMMs' epilogues): outside an enabled
    autocast, and none of them ever ran in FP8 (a recompute of an FP8 forward must go through
    :func:`fp8_linear`, which refuses a recompute outside the autocast)."""
    settings = current_settings()
    return (settings is None or not settings.records) and not any(s.ran_fp8 for s in scalings)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: GemmScaling, *,
    is_first_microbatch: bool | None = None,
) -> torch.Tensor:
    """y = x @ weight.T + bias, in FP8 inside an enabled autocast (see the module docstring).

    x: [..., K]; weight: [N, K]; bias: [N] or None; all of one float dtype. Returns [..., N] in
    x's dtype. Inside an autocast with FP8 on, K, N and the token count prod(x.shape[:-1]) must
    be multiples of 16 (ValueError otherwise). is_first_microbatch: None, True or False, the FP8
    weight cache (module docstring).
    """
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise ValueError(f"is_first_microbatch must be None, True or False; got {is_first_microbatch!r}")
    settings = current_settings()
    if settings is None or not settings.records:
        if scaling.ran_fp8 and torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(RECOMPUTE_OUTSIDE)
        return F.linear(x, weight, bias)
    recipe = settings.recipe
    if settings.fp8:
        scaling.ran_fp8 = True
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8_linear: weight has shape {tuple(weight.shape)}; expected [out_features, {k}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if settings.fp8:
        check_fp8_dims("fp8_linear", in_features=k, out_features=weight.shape[0], tokens=x2.shape[0])
        if is_first_microbatch is False and not recomputing():  # fail before anything is recorded
            scaling.cached_weight(weight, recipe.fp8_format.forward_dtype, recipe.name)
        if recipe.blockwise:
            from tachyon.fp8.block_linear import block_fp8_linear

            out = block_fp8_linear(x2, weight, bias, scaling, settings, is_first_microbatch)
            return out.reshape(*lead, weight.shape[0])
    out = _FP8Linear.apply(x2, weight, bias, scaling, settings, is_first_microbatch)
    return out.reshape(*lead, weight.shape[0])


EXTRA_STATE_VERSION = 2


def encode_extra_state(state: dict) -> torch.Tensor:
    """A module's FP8 state as a uint8 tensor (its torch.save bytes), what ``get_extra_state``
    returns: a tensor, so safetensors and Hugging Face's save_pretrained take it (Transformer
    Engine saves its extra state as bytes in a tensor too)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode_extra_state(state) -> dict:
    """The dict {"version", "gemms": {name: {role: {amax_history, scale, scale_inv}}}} from an
    ``_extra_state`` value: the uint8 tensor :func:`encode_extra_state` makes, or the dict that
    tachyon saved before (version 1). Read with ``torch.load(weights_only=True)``: tensors only."""
    if isinstance(state, torch.Tensor):
        if state.dtype != torch.uint8 or state.dim() != 1:
            raise ValueError(f"FP8 _extra_state must be a 1-D uint8 tensor (the saved bytes) or a dict; got a "
                             f"{state.dtype} tensor of shape {tuple(state.shape)}")
        try:
            state = torch.load(io.BytesIO(state.detach().cpu().numpy().tobytes()), weights_only=True)
        except Exception as error:
            raise ValueError(f"FP8 _extra_state bytes do not hold a saved FP8 state ({type(error).__name__}: "
                             f"{error})") from None
    if not isinstance(state, dict) or "gemms" not in state or not isinstance(state["gemms"], dict):
        raise ValueError(f"FP8 _extra_state must be a dict with 'gemms' (as saved by get_extra_state) or its bytes; "
                         f"got {type(state).__name__}")
    return state


class FP8ModuleMixin:
    """For nn.Modules with FP8 GEMMs: ``self.fp8_scaling`` {gemm name: GemmScaling}, saved in the
    module's state_dict as ``_extra_state``: a uint8 tensor holding the delayed-scaling state of
    every GEMM (:func:`encode_extra_state`; a tensor whatever the recipe, FP8 used or not, so
    safetensors files take it). The dict form of earlier versions loads too."""

    fp8_scaling: dict[str, GemmScaling]

    def _init_fp8_scaling(self, *names: str) -> None:
        self.fp8_scaling = {name: GemmScaling() for name in names}

    def fp8_state_dict(self) -> dict:
        """The FP8 state as a dict of plain CPU tensors (what ``_extra_state`` encodes)."""
        return {"version": EXTRA_STATE_VERSION, "gemms": {n: s.state_dict() for n, s in self.fp8_scaling.items()}}

    def get_extra_state(self) -> torch.Tensor:
        return encode_extra_state(self.fp8_state_dict())

    def set_extra_state(self, state) -> None:
        try:
            state = decode_extra_state(state)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None
        unknown = sorted(set(state["gemms"]) - set(self.fp8_scaling))
        if unknown:
            raise ValueError(f"{type(self).__name__}: FP8 state names unknown GEMMs {unknown}; this module has {sorted(self.fp8_scaling)}")
        for name, gemm_state in state["gemms"].items():
            self.fp8_scaling[name].load_state_dict(gemm_state)
            self.fp8_scaling[name].weight_cache = None  # cast from the weights before the load


__all__ = ["FP8ModuleMixin", "decode_extra_state", "encode_extra_state", "fp8_linear"]
