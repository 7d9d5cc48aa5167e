"""Current and block scaling in tachyon's modules: every FP8 module runs under each recipe (forward
and backward, in FP8: not the high-precision result, and close to it), activation checkpointing
recomputes bit for bit, the ``is_first_microbatch`` weight cache gives the uncached step bit for
bit, and the recipes keep no state; the recipe dataclasses carry Transformer Engine 2.x's fields
and defaults; autocast's arguments, refusals and the scale-update entry points."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import tachyon
import tachyon.nn as tnn
from tachyon.fp8 import (
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams, MXFP8BlockScaling, QParams, autocast,
    fp8_autocast, pending_states, reduce_and_update_fp8_tensors, update_module_scales,
)

HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 64, 2, 8, 2
STATELESS = {"current": Float8CurrentScaling(), "block": Float8BlockScaling(),
             "block-2d-input": Float8BlockScaling(fp8_format=Format.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1)}
MODULES = {
    "Linear": (lambda: tnn.Linear(HIDDEN, FFN), (SEQ * BATCH, HIDDEN)),
    "LayerNormLinear": (lambda: tnn.LayerNormLinear(HIDDEN, FFN), (SEQ, BATCH, HIDDEN)),
    "LayerNormMLP": (lambda: tnn.LayerNormMLP(HIDDEN, FFN, activation="swiglu"), (SEQ, BATCH, HIDDEN)),
    "MultiheadAttention": (lambda: tnn.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, input_layernorm=True),
                           (SEQ, BATCH, HIDDEN)),
    "TransformerLayer": (lambda: tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0),
                         (SEQ, BATCH, HIDDEN)),
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _fwd_bwd(module, x, g, recipe=None, **kwargs):
    x = x.clone().requires_grad_()
    context = autocast(recipe=recipe) if recipe is not None else autocast(enabled=False)
    with context:
        y = _first(module(x, **kwargs))
    y.backward(g)
    return [y.detach(), x.grad, *(p.grad.clone() for p in module.parameters())]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _states(module):
    return [t.clone() for sub in module.modules() for gemm in getattr(sub, "fp8_scaling", {}).values()
            for role in ("input", "weight", "grad_output")
            for t in (getattr(gemm, role).amax_history, getattr(gemm, role).scale)]


@pytest.mark.parametrize("recipe", list(STATELESS))
@pytest.mark.parametrize("name", list(MODULES))
def test_every_fp8_module_runs_each_recipe_forward_and_backward(name, recipe):
    make, shape = MODULES[name]
    torch.manual_seed(0)
    module = make()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    g = torch.randn(_first(module(x)).shape, generator=gen)
    before = _states(module)
    module.zero_grad()
    high = _fwd_bwd(module, x, g)
    module.zero_grad()
    fp8 = _fwd_bwd(module, x, g, STATELESS[recipe])
    assert all(s.ran_fp8 for sub in module.modules() for s in getattr(sub, "fp8_scaling", {}).values())
    assert not torch.equal(fp8[0], high[0]), "the output is the high-precision one: FP8 did not run"
    for i, (a, b) in enumerate(zip(fp8, high)):  # E4M3 keeps ~2 significant digits; E5M2 gradients fewer
        assert torch.isfinite(a).all() and _rel(a, b) < 0.2, f"tensor {i}: relative error {_rel(a, b):.3f}"
    assert all(torch.equal(a, b) for a, b in zip(_states(module), before)), "a stateless recipe changed the state"


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_checkpointed_layers_recompute_bit_for_bit_with_the_weight_cache(recipe):
    """Two TransformerLayers under tachyon.checkpointing.checkpoint, a step of 2 micro-batches with
    is_first_microbatch True then False: outputs and gradients equal the plain uncached run."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1)
                                 for _ in range(2))
    other = copy.deepcopy(layers)

    def run(stack, checkpointed):
        gen = torch.Generator().manual_seed(3)
        outs = []
        for micro in range(2):
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).requires_grad_()
            torch.manual_seed(10 + micro)  # dropout
            with autocast(recipe=STATELESS[recipe]):
                h = x
                for layer in stack:
                    if checkpointed:
                        h = tachyon.checkpointing.checkpoint(layer, h, is_first_microbatch=micro == 0)
                    else:
                        h = layer(h)
            h.backward(torch.randn(h.shape, generator=gen))
            outs += [h.detach(), x.grad]
        return outs + [p.grad for p in stack.parameters()]

    for a, b in zip(run(layers, True), run(other, False)):
        assert torch.equal(a, b)


def test_cached_weight_of_another_recipe_is_refused():
    layer = tnn.Linear(HIDDEN, HIDDEN)
    x = torch.randn(16, HIDDEN)
    with autocast(recipe=Float8CurrentScaling()):
        layer(x, is_first_microbatch=True)
    with autocast(recipe=Float8BlockScaling()), pytest.raises(ValueError, match="cast under the 'current' recipe"):
        layer(x, is_first_microbatch=False)


def test_recipes_carry_transformer_engines_fields_and_defaults():
    current = Float8CurrentScaling()
    assert (current.fp8_format, current.use_power_2_scales, current.fp8_dpa, current.fp8_mha,
            current.backward_override) == (Format.HYBRID, False, False, False, None)
    assert current.fp8_quant_fwd_inp == current.fp8_quant_fwd_weight == current.fp8_quant_bwd_grad == QParams(False, 0.0)
    assert (current.fp8_gemm_fprop, current.fp8_gemm_dgrad, current.fp8_gemm_wgrad) == (
        MMParams(False), MMParams(True), MMParams(True))
    assert Float8CurrentScaling(use_power_2_scales=True).fp8_quant_bwd_grad == QParams(True, 0.0)
    block = Float8BlockScaling()
    assert (block.fp8_format, block.use_f32_scales, block.x_block_scaling_dim, block.w_block_scaling_dim,
            block.grad_block_scaling_dim) == (Format.E4M3, False, 1, 2, 1)
    assert block.fp8_quant_fwd_inp == QParams(True, 0.0) and block.fp8_gemm_fprop == MMParams(True)
    assert Float8BlockScaling(use_f32_scales=True).fp8_quant_fwd_weight == QParams(False, 0.0)
    mx = MXFP8BlockScaling()
    assert (mx.margin, mx.fp8_format, mx.fp8_dpa, mx.fp8_mha) == (0, Format.E4M3, False, False)
    assert current.float8_current_scaling() and current.float8_per_tensor_scaling() and not current.delayed()
    assert block.float8_block_scaling() and mx.mxfp8() and DelayedScaling().delayed()
    with pytest.raises(dataclasses.FrozenInstanceError):
        block.x_block_scaling_dim = 2


@pytest.mark.parametrize("make,message", [
    (lambda: Float8CurrentScaling(fp8_format=Format.E5M2), "Format.E5M2 is not supported"),
    (lambda: Float8BlockScaling(x_block_scaling_dim=2), "x_block_scaling_dim=2 and w_block_scaling_dim=2"),
    (lambda: Float8BlockScaling(grad_block_scaling_dim=3), "grad_block_scaling_dim must be 1 .* or 2"),
    (lambda: Float8BlockScaling(fp8_gemm_dgrad=MMParams(False)), "use_split_accumulator must be True"),
    (lambda: Float8CurrentScaling(fp8_dpa=True), "FP8 attention\\) is not implemented"),
    (lambda: Float8CurrentScaling(backward_override="high_precision"), "backward_override='high_precision' is not"),
    (lambda: Float8CurrentScaling(fp8_quant_fwd_inp=True), "fp8_quant_fwd_inp must be a tachyon.fp8.QParams"),
    (lambda: QParams(amax_epsilon=-1.0), "amax_epsilon must be a float >= 0"),
    (lambda: MXFP8BlockScaling(margin=1), "margin must be 0"),
])
def test_bad_recipe_arguments_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_autocast_signature_refusals_and_fp8_autocast_alias():
    assert tachyon.autocast is autocast and tachyon.fp8_autocast is fp8_autocast
    with pytest.raises(RuntimeError, match="MXFP8BlockScaling needs a GPU of compute capability 10.x .* runs on cpu"):
        autocast(recipe=MXFP8BlockScaling())
    with autocast(enabled=False, recipe=MXFP8BlockScaling()):  # not enabled: nothing to run
        pass
    with pytest.raises(ValueError, match="calibrating=True collects the amax statistics delayed scaling"):
        autocast(enabled=False, calibrating=True, recipe=Float8BlockScaling())
    with pytest.raises(ValueError, match="recipe must be a tachyon.fp8 recipe"):
        autocast(recipe="current")
    context = autocast(recipe=Float8CurrentScaling())
    with context, pytest.raises(RuntimeError, match="this context is open already"):
        with context:
            pass
    assert isinstance(fp8_autocast(fp8_recipe=Float8CurrentScaling(), fp8_group=None).recipe, Float8CurrentScaling)


def test_scale_updates_on_demand_and_for_graph_replays():
    """_graph=True leaves the forward states pending; reduce_and_update_fp8_tensors updates them (and
    the backward ones); update_module_scales updates given modules' states with nothing pending (a
    CUDA-graph replay runs no Python), and does nothing for a stateless recipe."""
    layer = tnn.Linear(HIDDEN, HIDDEN)
    state = layer.fp8_scaling["gemm"]
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    x = torch.randn(16, HIDDEN) * 4
    with autocast(recipe=recipe, _graph=True):
        y = layer(x)
    assert pending_states(forward=True) == 1 and state.input.scale.item() == 1.0
    assert reduce_and_update_fp8_tensors(forward=True) == 2 and pending_states(forward=True) == 0
    assert state.input.scale.item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)
    y.sum().backward()  # the end of the pass updated grad_output already
    assert pending_states(forward=False) == 0 and state.grad_output.scale.item() != 1.0
    # a replay: the amax was recorded in place by the kernels, nothing is pending
    state.input.amax_history[0] = 2.0
    assert update_module_scales([layer], recipe, forward=True) == 2
    assert state.input.scale.item() == pytest.approx(448.0 / 2.0)
    assert update_module_scales(layer, Float8CurrentScaling()) == 0
