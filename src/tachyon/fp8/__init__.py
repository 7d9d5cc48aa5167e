"""FP8 training, Transformer Engine 2.x style: delayed, current and block scaling.

    import tachyon
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format

    recipe = Float8CurrentScaling()          # or DelayedScaling(...), Float8BlockScaling()
    with tachyon.autocast(enabled=True, recipe=recipe):
        y = model(x)              # tachyon.nn.Linear / LayerNormLinear / LayerNormMLP GEMMs in FP8
    y.float().pow(2).mean().backward()   # outside the context

``tachyon.fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)`` is the same context under
Transformer Engine 1.x's names. The recipes (tachyon.fp8.recipe has the table):
DelayedScaling (scales from past amaxes, below), Float8CurrentScaling (each tensor's scale from
its own amax, in the same step), Float8BlockScaling (a power-of-2 scale per 1 x 128 block of
inputs and gradients and per 128 x 128 block of weights, E4M3 everywhere; tachyon.fp8.block_linear)
and MXFP8BlockScaling (1 x 32 blocks; compute capability 10.x only). Everything below about
histories, updates, calibration and checkpointed scales concerns delayed scaling, the one recipe
with state; the other recipes keep none and compute every scale from the tensor being cast.

Why scaling. FP8 has few bits: E4M3 (max 448, 3 mantissa bits) keeps ~2 significant digits over
about 18 binades, E5M2 (max 57344, 2 mantissa bits) trades precision for range. A tensor whose
values sit around 1e-3 would lose most of them to underflow, one around 1e3 would saturate. So
each tensor is multiplied by a per-tensor ``scale`` before the cast, chosen so its largest
magnitude (its *amax*) lands just under the format's max:

    scale     = fp8_max / amax / 2**margin
    x_fp8     = cast(clamp(x * scale, -fp8_max, fp8_max))        # saturating cast
    x @ w.T  ~= (x_fp8 @ w_fp8.T) * scale_inv_x * scale_inv_w     # scale_inv = 1 / scale

Why *delayed*. Computing the amax of a tensor and then scaling it needs two passes over it (and
a host round trip on a GPU). Delayed scaling instead uses the amaxes of *previous* steps: every
GEMM operand keeps an ``amax_history`` of the last ``amax_history_len`` steps. In step t the cast
uses the scale computed from the history up to step t-1, while the amax of the tensor being cast
is recorded into the history's newest slot in the same pass. After the step (when the outermost
``fp8_autocast`` exits for the forward operands, and when the backward pass ends for the
gradients, all of a pass's GEMMs together) the history becomes a new scale:

    history[0] = all_reduce(history[0], MAX)   over fp8_group, when given and recipe.reduce_amax
    amax  = max(history)           amax_compute_algo="max" (robust to one quiet step)
          | history[0]             "most_recent" (follows fast changes)
          | fn(history)            a callable
    scale = fp8_max / amax / 2**margin    (kept as it was when amax is 0 or not finite)

and the history rolls by one slot. Reducing the newest slot (rather than the computed amax)
keeps every rank's history identical, so for "max" and "most_recent" it is the same as reducing
the amax, and every rank's scales (and checkpoints) agree. A tensor whose amax grows by more
than 2**margin within one step saturates at +-fp8_max for that step; the next scale catches up.

Formats. Format.HYBRID (the default) casts the forward operands (inputs, weights) to E4M3 and the
gradients to E5M2: gradients span more binades and need E5M2's range. Format.E4M3 uses E4M3
everywhere. An E5M2-only recipe is refused (forward values need E4M3's precision).

State. Each FP8 GEMM of a module (tachyon.fp8.GemmScaling) holds one ScalingState per operand
role -- input, weight, grad_output -- with ``amax_history`` [amax_history_len], ``scale`` and
``scale_inv`` (fp32). It is part of the module's state_dict (``_extra_state``), so checkpoints
resume with the same scales.

Calibration (Transformer Engine's meaning). ``enabled`` decides the numerics, ``calibrating``
only adds recording: ``fp8_autocast(enabled=False, calibrating=True)`` runs the GEMMs in high
precision but records the amaxes and updates the scales, so that a model trained in bf16 can be
saved with FP8 scales ready, or an FP8 run can start from well-chosen ones. ``enabled=True`` runs
FP8 (and records) whatever ``calibrating`` says.

Gradient accumulation (``is_first_microbatch``). The weights do not change between the
micro-batches of one optimizer step, so their FP8 casts can be reused: every FP8 module's
forward (Linear, LayerNormLinear, LayerNormMLP, MultiheadAttention, TransformerLayer) takes
``is_first_microbatch``: None (default) casts the weight every call; True casts it, records its
amax and caches the FP8 weight with the scale_inv it was cast with; False reuses the cache (no
weight cast, no weight amax recorded; ValueError when nothing is cached). It has no effect
outside an enabled fp8_autocast.

    for i, micro_batch in enumerate(micro_batches):
        with tachyon.fp8_autocast():
            loss = model(micro_batch, is_first_microbatch=(i == 0)).float().mean()
        loss.backward()
    optimizer.step()

Activation checkpointing. A checkpointed region is recomputed during the backward, after its
fp8_autocast exited and updated the scales. ``tachyon.checkpointing.checkpoint`` (and
``checkpoint_sequential``) recompute FP8 regions faithfully: the same autocast settings, the
scales the forward used, no amax recorded twice, no second scale update (Transformer Engine's
checkpoint does the same). With PyTorch's own checkpoint pass
``context_fn=tachyon.fp8.fp8_checkpoint_context_fn()`` (with ``use_reentrant=False``); without
it (or with the reentrant checkpoint, which takes none) an FP8 GEMM recomputed outside the
autocast raises a RuntimeError naming the fix.

Hardware. On CUDA devices of compute capability >= 8.9 (Ada, Hopper, Blackwell) the per-tensor
GEMM is ``torch._scaled_mm`` on FP8 tensor cores, and a block-scaled one too where this torch
runs its blockwise scaling (compute capability 9.0, CUDA 12.9+). Elsewhere (older GPUs, CPU) it
is emulated with the same numerics: cast to FP8 and back, multiply by scale_inv (per block),
matmul in fp32. Every GEMM dimension must be a multiple of 16 either way
(:func:`gemm_paths` and ``tachyon info`` say which path runs for each recipe).

CUDA graphs. :func:`reduce_and_update_fp8_tensors` (Transformer Engine's name) updates the
pending delayed-scaling states of a pass on demand, and :func:`update_module_scales` those of
given modules after graph replays (tachyon.fp8.pending says when each applies).
"""

from __future__ import annotations

from tachyon.fp8.context import (
    AutocastSettings, autocast, autocast_active, current_settings, fp8_autocast, is_fp8_enabled, recipe_support,
    recomputing,
)
from tachyon.fp8.block_gemm import block_gemm, block_gemm_support
from tachyon.fp8.checkpoint import fp8_checkpoint_context_fn, fp8_checkpoint_contexts
from tachyon.fp8.gemm import FP8_ALIGNMENT, cast_from_fp8, cast_to_fp8, check_fp8_dims, fp8_gemm, native_fp8_supported
from tachyon.fp8.linear import FP8ModuleMixin, decode_extra_state, encode_extra_state, fp8_linear
from tachyon.fp8.paths import gemm_paths, is_fp8_available, is_fp8_block_scaling_available, is_mxfp8_available
from tachyon.fp8.pending import pending_states, reduce_and_update_fp8_tensors, update_module_scales
from tachyon.fp8.quantize import BlockQuantized, compute_scale, current_scale, dequantize, quantize_blocks
from tachyon.fp8.recipe import (
    FP8_E4M3, FP8_E5M2, FP8_MAX, RECIPES, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams,
    MXFP8BlockScaling, QParams, Recipe,
)
from tachyon.fp8.scaling import CachedWeight, GemmScaling, ScalingState, reduce_amax, update_scales

__all__ = [
    "FP8_ALIGNMENT", "FP8_E4M3", "FP8_E5M2", "FP8_MAX", "RECIPES", "AutocastSettings", "BlockQuantized", "CachedWeight",
    "DelayedScaling", "FP8ModuleMixin", "Float8BlockScaling", "Float8CurrentScaling", "Format", "GemmScaling",
    "MMParams", "MXFP8BlockScaling", "QParams", "Recipe", "ScalingState", "autocast", "autocast_active", "block_gemm",
    "block_gemm_support", "cast_from_fp8", "cast_to_fp8", "check_fp8_dims", "compute_scale", "current_scale",
    "current_settings", "decode_extra_state", "dequantize", "encode_extra_state", "fp8_autocast",
    "fp8_checkpoint_context_fn", "fp8_checkpoint_contexts", "fp8_gemm", "fp8_linear", "gemm_paths",
    "is_fp8_available", "is_fp8_block_scaling_available", "is_fp8_enabled", "is_mxfp8_available", "native_fp8_supported", "pending_states", "quantize_blocks", "recipe_support", "recomputing",
    "reduce_amax", "reduce_and_update_fp8_tensors", "update_module_scales", "update_scales",
]
