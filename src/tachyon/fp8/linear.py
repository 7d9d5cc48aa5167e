"""``fp8_linear``: the linear layer every FP8-capable module calls, and the module mixin that keeps
each GEMM's scaling state in the module's state_dict.

    out = fp8_linear(x, weight, bias, scaling)      # x [..., K], weight [N, K], bias [N] or None

Outside fp8_autocast this is ``F.linear`` in the inputs' dtype. Inside one (enabled), the GEMM
runs in FP8 with the delayed scales of ``scaling`` (a :class:`GemmScaling`):

    forward   x8 = fp8(x * s_x), w8 = fp8(w * s_w)       E4M3
              out = (x8 @ w8.T) * (1/s_x) * (1/s_w) + bias
    backward  g8 = fp8(grad_out * s_g)                   E5M2 (HYBRID) or E4M3
              dgrad  dx = (g8 @ w8) / (s_g s_w)
              wgrad  dw = (g8.T @ x8) / (s_g s_x)
              dbias  = grad_out.sum(0) in high precision

Each cast records its operand's amax in the same pass (tachyon.fp8.cast_to_fp8: one fused
Triton kernel on GPUs). Saved for backward: x8 and w8 (FP8, a quarter of fp32's memory) and the
two scale_inv values used in the forward (copies, so a later scale update cannot change this
step's gradients). Where torch._scaled_mm runs, the casts also write x8.T and w8.T contiguous
(the layouts the dgrad/wgrad GEMMs take) and those are saved instead, so the backward makes no
transposing copies; the gradient's cast writes g8.T in the same pass when wgrad is needed. The
grad_output scales of all the FP8 GEMMs a backward pass ran are updated together when that pass
ends (one update_scales call, one amax all-reduce, queued on the autograd engine as Transformer
Engine does); the input and weight scales when the outermost fp8_autocast exits. In calibration (``fp8_autocast(enabled=False,
calibrating=True)``) the same three amaxes are recorded but every GEMM runs in high precision.

FP8 weight caching (``is_first_microbatch``, Transformer Engine's argument). With gradient
accumulation the weights do not change between the micro-batches of a step, so their FP8 cast
need not be repeated:

    None    no caching: the weight is cast (and its amax recorded) on every call
    True    first micro-batch: cast and record as usual, and keep the FP8 weight and the
            scale_inv it was cast with in ``scaling.weight_cache``
    False   a later micro-batch: use the cached pair; no weight cast, no weight amax recorded
            (ValueError when nothing fitting is cached)

Only FP8 runs are affected: outside fp8_autocast and in calibration the argument is ignored.
The weight's state still takes part in every scale update, as in Transformer Engine: over a step
of n micro-batches its amax history gets one record (the first micro-batch's) and is rolled n
times. The cached pair stays consistent whatever the scale updates do in between; the caller
guarantees that the weights did not change since the True call (the optimizer steps after the
last micro-batch). Inside an activation-checkpointed region the recomputation repeats exactly
what the forward did (:mod:`tachyon.fp8.checkpoint`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tachyon.fp8.autocast import AutocastSettings, autocast_active, current_settings, recomputing, register_forward
from tachyon.fp8.checkpoint import GemmCall, note_call, recording, replay_call
from tachyon.fp8.gemm import cast_to_fp8, check_fp8_dims, fp8_gemm, native_fp8_supported
from tachyon.fp8.scaling import CachedWeight, GemmScaling, update_scales

_BACKWARD_INSIDE = (
    "backward was called inside fp8_autocast; call backward outside fp8_autocast (the context "
    "wraps the forward only: the forward's scales are updated when it exits)"
)


_RECOMPUTE_OUTSIDE = (
    "an FP8 GEMM that ran in FP8 is being recomputed during backward outside fp8_autocast, which "
    "would give high-precision activations for an FP8 forward: an activation checkpoint that "
    "cannot restore the autocast (torch.utils.checkpoint with use_reentrant=True, or with "
    "use_reentrant=False but no context_fn). Use tachyon.checkpointing.checkpoint, or "
    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False, "
    "context_fn=tachyon.fp8.fp8_checkpoint_context_fn())"
)


class _FP8Linear(torch.autograd.Function):
    """x [M, K] @ weight[N, K].T (+ bias [N]) with FP8 numerics or amax recording (calibration)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling: GemmScaling, settings: AutocastSettings, is_first_microbatch):
        recipe = settings.recipe
        scaling.prepare(recipe.amax_history_len, x.device)
        record = not recomputing()  # a recomputation records nothing: the forward did
        ctx.transposed = False
        if settings.fp8:
            # the casts record the amaxes in the same pass (a reused cached weight records none)
            ctx.transposed = transposed_operands(x.device)
            x8, w8, sx, sw, x8_t, w8_t = _cast_operands(
                x, weight, scaling, recipe.fp8_format.forward_dtype, is_first_microbatch, record, ctx.transposed)
            out = fp8_gemm(x8, sx, w8, sw, x.dtype)
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
        register_forward(scaling, settings)
        ctx.scaling, ctx.settings = scaling, settings
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if autocast_active():
            raise RuntimeError(_BACKWARD_INSIDE)
        settings, state = ctx.settings, ctx.scaling.grad_output
        recipe = settings.recipe
        grad_out = grad_out.contiguous()
        state.prepare(recipe.amax_history_len, grad_out.device)
        dx = dw = None
        if settings.fp8:
            x8, w8, sx, sw = ctx.saved_tensors  # x8_t [K, M], w8_t [K, N] when ctx.transposed
            want_t = ctx.transposed and ctx.needs_input_grad[1]
            cast = cast_to_fp8(grad_out, state.scale, recipe.fp8_format.backward_dtype, state.amax_history[0],
                               transpose=want_t)
            g8, g8_t = cast if want_t else (cast, None)
            sg = state.scale_inv  # the update at the end of the backward pass changes it after these GEMMs
            if ctx.needs_input_grad[0]:  # dx [M, K] = g8 [M, N] @ w8 [N, K]
                dx = fp8_gemm(g8, sg, w8 if ctx.transposed else w8.t(), sw, ctx.x_dtype)
            if ctx.needs_input_grad[1]:  # dw [N, K] = g8.T [N, M] @ x8 [M, K]
                dw = (fp8_gemm(g8_t, sg, x8, sx, ctx.w_dtype) if ctx.transposed
                      else fp8_gemm(g8.t(), sg, x8.t(), sx, ctx.w_dtype))
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
        _update_after_backward(state, recipe, settings.group)
        return dx, dw, db, None, None, None


_backward_pending: dict[int, tuple] = {}


def _update_after_backward(state, recipe, group) -> None:
    """Queue this grad_output state's scale update for the end of the running backward pass:
    every FP8 GEMM's state of the pass in one :func:`update_scales` call (stacked, one all-reduce
    per fp8_group) instead of about 14 small ops and an all-reduce per GEMM. A GEMM run twice in
    one pass records the larger amax and updates once. Every call queues the flush (the first one
    of a pass does the work, the rest find nothing): a pass that raised before its end never ran
    its callbacks, and a flush queued only when nothing was pending would then never run again."""
    _backward_pending[id(state)] = (state, recipe, group)
    torch.autograd.Variable._execution_engine.queue_callback(_flush_backward)


def _flush_backward() -> None:
    if not _backward_pending:
        return
    items = list(_backward_pending.values())
    _backward_pending.clear()
    update_scales(items)


def transposed_operands(device: torch.device) -> bool:
    """Whether the FP8 casts also write the transposed copies the backward GEMMs take (where
    torch._scaled_mm runs: it wants a row-major first and a column-major second operand, so the
    emulation, which takes any layout, skips them)."""
    return native_fp8_supported(device)


def _cast(x, scale, fp8_dtype, amax, transpose: bool):
    out = cast_to_fp8(x, scale, fp8_dtype, amax, transpose=transpose)
    return out if transpose else (out, None)


def _cast_operands(x, weight, scaling: GemmScaling, fp8_dtype: torch.dtype, is_first_microbatch: bool | None,
                   record: bool, transpose: bool):
    """(x8, w8, x scale_inv, w scale_inv, x8_t, w8_t) for the FP8 GEMM: the live scales, or in a
    checkpointed region's recomputation the ones its forward used; the weight from the cache when
    asked. Each cast records its operand's amax when ``record`` (not for a cached weight). The
    transposed copies are None unless ``transpose``."""
    replay = replay_call(scaling)
    if replay is None:
        x_scale, sx = scaling.input.scale, scaling.input.scale_inv.clone()
    else:
        x_scale, sx = replay.input_scale, replay.input_scale_inv
    x8, x8_t = _cast(x, x_scale, fp8_dtype, scaling.input.amax_history[0] if record else None, transpose)
    w_scale = cached = w8_t = None
    if replay is not None and replay.cached_weight is not None:
        cached, sw = replay.cached_weight, replay.weight_scale_inv
        w8 = cached
    elif is_first_microbatch is False:
        cache = scaling.cached_weight(weight, fp8_dtype)
        cached, sw, w8_t = cache.data, cache.scale_inv, cache.data_t
        w8 = cached
    else:
        if replay is None:
            w_scale, sw = scaling.weight.scale, scaling.weight.scale_inv.clone()
        else:
            w_scale, sw = replay.weight_scale, replay.weight_scale_inv
        w8, w8_t = _cast(weight, w_scale, fp8_dtype, scaling.weight.amax_history[0] if record else None, transpose)
        if is_first_microbatch and replay is None:
            scaling.weight_cache = CachedWeight(w8, sw, w8_t)
    if transpose and w8_t is None:
        w8_t = w8.t().contiguous()
    if recording():
        note_call(scaling, GemmCall(x_scale.clone(), sx, None if w_scale is None else w_scale.clone(), sw, cached))
    return x8, w8, sx, sw, x8_t, w8_t


def runs_high_precision(*scalings: GemmScaling) -> bool:
    """True where these GEMMs run as plain GEMMs now, so a module may run them fused with what
    sits beside them (LayerNormMLP: the activation in the GEMMs' epilogues): outside an enabled
    fp8_autocast, and none of them ever ran in FP8 (a recompute of an FP8 forward must go through
    :func:`fp8_linear`, which refuses a recompute outside the autocast)."""
    settings = current_settings()
    return (settings is None or not settings.records) and not any(s.ran_fp8 for s in scalings)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scaling: GemmScaling, *,
    is_first_microbatch: bool | None = None,
) -> torch.Tensor:
    """y = x @ weight.T + bias, in FP8 inside an enabled fp8_autocast (see the module docstring).

    x: [..., K]; weight: [N, K]; bias: [N] or None; all of one float dtype. Returns [..., N] in
    x's dtype. Inside fp8_autocast with FP8 on, K, N and the token count prod(x.shape[:-1]) must
    be multiples of 16 (ValueError otherwise). is_first_microbatch: None, True or False, the FP8
    weight cache (module docstring).
    """
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise ValueError(f"is_first_microbatch must be None, True or False; got {is_first_microbatch!r}")
    settings = current_settings()
    if settings is None or not settings.records:
        if scaling.ran_fp8 and torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(_RECOMPUTE_OUTSIDE)
        return F.linear(x, weight, bias)
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
            scaling.cached_weight(weight, settings.recipe.fp8_format.forward_dtype)
    out = _FP8Linear.apply(x2, weight, bias, scaling, settings, is_first_microbatch)
    return out.reshape(*lead, weight.shape[0])


class FP8ModuleMixin:
    """For nn.Modules with FP8 GEMMs: ``self.fp8_scaling`` {gemm name: GemmScaling}, saved in the
    module's state_dict as ``_extra_state`` (nested dicts of plain CPU tensors, so the state_dict
    loads with ``torch.load(weights_only=True)``)."""

    fp8_scaling: dict[str, GemmScaling]
    _FP8_STATE_VERSION = 1

    def _init_fp8_scaling(self, *names: str) -> None:
        self.fp8_scaling = {name: GemmScaling() for name in names}

    def get_extra_state(self) -> dict:
        return {"version": self._FP8_STATE_VERSION, "gemms": {n: s.state_dict() for n, s in self.fp8_scaling.items()}}

    def set_extra_state(self, state) -> None:
        if not isinstance(state, dict) or "gemms" not in state:
            raise ValueError(
                f"{type(self).__name__}: _extra_state must be a dict with 'gemms' (as saved by "
                f"get_extra_state); got {type(state).__name__}"
            )
        unknown = sorted(set(state["gemms"]) - set(self.fp8_scaling))
        if unknown:
            raise ValueError(f"{type(self).__name__}: FP8 state names unknown GEMMs {unknown}; this module has {sorted(self.fp8_scaling)}")
        for name, gemm_state in state["gemms"].items():
            self.fp8_scaling[name].load_state_dict(gemm_state)
            self.fp8_scaling[name].weight_cache = None  # cast from the weights before the load


__all__ = ["FP8ModuleMixin", "fp8_linear"]
