"""``is_first_microbatch``: Transformer Engine's FP8 weight cache across gradient-accumulation
micro-batches, on every FP8 module. With the cache, a step of 4 micro-batches gives the outputs
and accumulated gradients of the uncached run bit for bit, casts each weight once, and leaves the
amax histories and scales as Transformer Engine would: the weight's history gets one record."""

from __future__ import annotations

import copy

import pytest
import torch

import tachyon.fp8.linear as fp8_linear_module
import tachyon.nn as tnn
from tachyon.fp8 import DelayedScaling, fp8_autocast

HIDDEN, FFN, HEADS, SEQ, BATCH, MICRO_BATCHES = 32, 64, 2, 8, 2, 4
RECIPE = DelayedScaling(amax_history_len=8)
ROLES = ("input", "weight", "grad_output")


def _decoder_call(module, x, **kwargs):
    return module(x, encoder_output=torch.ones_like(x).mul_(0.5).add_(x.detach().flip(0)), **kwargs)


MODULES = {  # name -> (constructor, input shape [tokens = 16], how to call it)
    "Linear": (lambda: tnn.Linear(HIDDEN, FFN), (2, SEQ, HIDDEN), None),
    "LayerNormLinear": (lambda: tnn.LayerNormLinear(HIDDEN, FFN, return_layernorm_output=True), (SEQ * BATCH, HIDDEN), None),
    "LayerNormMLP": (lambda: tnn.LayerNormMLP(HIDDEN, FFN, activation="swiglu"), (SEQ, BATCH, HIDDEN), None),
    "MultiheadAttention": (
        lambda: tnn.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0, input_layernorm=True),
        (SEQ, BATCH, HIDDEN), None),
    "TransformerLayer": (lambda: tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0),
                         (SEQ, BATCH, HIDDEN), None),
    "TransformerLayer-decoder": (
        lambda: tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, layer_type="decoder"),
        (SEQ, BATCH, HIDDEN), _decoder_call),
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _step(module, xs, gs, call, **kwargs):
    """One optimizer step's worth of micro-batches under fp8_autocast (each its own context, as in
    TE); returns the outputs and input gradients, leaving the accumulated gradients in .grad."""
    outs, dxs = [], []
    for i, (x, g) in enumerate(zip(xs, gs)):
        x = x.clone().requires_grad_()
        flag = {k: v(i) for k, v in kwargs.items()}
        with fp8_autocast(fp8_recipe=RECIPE):
            y = _first(call(module, x, **flag) if call else module(x, **flag))
        y.backward(g)
        outs.append(y.detach())
        dxs.append(x.grad)
    return outs, dxs


def _states(module):
    return {f"{name}.{role}": getattr(gemm, role) for name, gemm in _all_gemms(module) for role in ROLES}


def _all_gemms(module):
    for prefix, sub in module.named_modules():
        for name, gemm in getattr(sub, "fp8_scaling", {}).items():
            yield f"{prefix}.{name}" if prefix else name, gemm


@pytest.mark.parametrize("name", list(MODULES))
def test_cached_fp8_weights_give_the_uncached_step_and_cast_each_weight_once(name, monkeypatch):
    make, shape, call = MODULES[name]
    torch.manual_seed(0)
    cached = make()
    uncached = copy.deepcopy(cached)
    gen = torch.Generator().manual_seed(1)
    warm_x = torch.randn(shape, generator=gen)
    out_shape = _first(call(cached, warm_x) if call else cached(warm_x)).shape
    warm_g = torch.randn(out_shape, generator=gen)
    # a first step, uncached in both: the weights' scales settle (amax in the history), so that
    # the uncached run casts its weights with one scale in all 4 micro-batches of the next step
    for module in (cached, uncached):
        _step(module, [warm_x], [warm_g], call)
        module.zero_grad(set_to_none=True)
    xs = [torch.randn(shape, generator=gen) * (i + 1) for i in range(MICRO_BATCHES)]
    gs = [torch.randn(out_shape, generator=gen) for _ in range(MICRO_BATCHES)]

    casts = []
    original = fp8_linear_module.cast_to_fp8

    def counting_cast(x, scale, dtype, amax=None, **kwargs):
        if fp8_linear_module.autocast_active():  # forward casts only (backward runs outside)
            casts.append(tuple(x.shape))
        return original(x, scale, dtype, amax, **kwargs)

    monkeypatch.setattr(fp8_linear_module, "cast_to_fp8", counting_cast)
    got_out, got_dx = _step(cached, xs, gs, call, is_first_microbatch=lambda i: i == 0)
    cached_casts = len(casts)
    casts.clear()
    want_out, want_dx = _step(uncached, xs, gs, call)
    gemms = len(list(_all_gemms(cached)))
    assert cached_casts == gemms * (MICRO_BATCHES + 1), "each weight is cast once, each input every micro-batch"
    assert len(casts) == gemms * 2 * MICRO_BATCHES

    for i in range(MICRO_BATCHES):
        assert torch.equal(got_out[i], want_out[i]), f"output of micro-batch {i}"
        assert torch.equal(got_dx[i], want_dx[i]), f"input gradient of micro-batch {i}"
    for (pname, p), q in zip(cached.named_parameters(), uncached.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), f"accumulated gradient of {pname}"

    want_states = _states(uncached)
    for key, state in _states(cached).items():
        want = want_states[key]
        assert torch.equal(state.scale, want.scale) and torch.equal(state.scale_inv, want.scale_inv), key
        if not key.endswith(".weight"):
            assert torch.equal(state.amax_history, want.amax_history), key
            continue
        # TE: the weight is recorded in the first micro-batch only, and its history rolls at
        # every micro-batch's autocast exit; newest first: [now, mb4, mb3, mb2, mb1, warm-up, 0...]
        amax = want.amax_history[4]
        assert amax > 0 and torch.equal(want.amax_history[1:6], amax.repeat(5)), key
        expected = torch.zeros_like(want.amax_history)
        expected[4:6] = amax
        assert torch.equal(state.amax_history, expected), f"{key}: {state.amax_history.tolist()}"
        assert state.scale.item() == pytest.approx(448.0 / amax.item(), rel=1e-6), key


def test_the_cache_holds_the_fp8_weight_and_the_scale_inv_it_was_cast_with():
    layer = tnn.Linear(HIDDEN, FFN)
    gemm = layer.fp8_scaling["gemm"]
    assert gemm.weight_cache is None
    x = torch.randn(16, HIDDEN)
    with fp8_autocast():
        layer(x)  # None: no caching
    assert gemm.weight_cache is None
    scale, scale_inv = gemm.weight.scale.clone(), gemm.weight.scale_inv.clone()  # set by the first exit
    assert scale.item() != 1.0
    with fp8_autocast():
        layer(x, is_first_microbatch=True)
    cache = gemm.weight_cache
    assert cache.data.dtype == torch.float8_e4m3fn and cache.data.shape == layer.weight.shape
    assert torch.equal(cache.scale_inv, scale_inv)
    assert torch.equal(cache.data.float(), fp8_linear_module.cast_to_fp8(layer.weight.detach(), scale, cache.data.dtype).float())
    # a later scale update changes the state, not the cached pair
    with torch.no_grad():
        layer.weight.mul_(4)
    with fp8_autocast():
        layer(x)
    assert not torch.equal(gemm.weight.scale_inv, scale_inv) and torch.equal(cache.scale_inv, scale_inv)


def test_false_without_a_cache_is_an_error_that_records_nothing():
    mlp = tnn.LayerNormMLP(HIDDEN, FFN)
    x = torch.randn(16, HIDDEN)
    with pytest.raises(ValueError, match="is_first_microbatch=False, but this GEMM has no cached FP8 weight yet"):
        with fp8_autocast():
            mlp(x, is_first_microbatch=False)
    for key, state in _states(mlp).items():
        assert state.amax_history.abs().sum() == 0 and state.scale.item() == 1.0, key
    with fp8_autocast():
        mlp(x, is_first_microbatch=True)
    mlp.load_state_dict(mlp.state_dict())  # loading (new weights, new scales) drops the cache
    with pytest.raises(ValueError, match="no cached FP8 weight yet"):
        with fp8_autocast():
            mlp(x, is_first_microbatch=False)


def test_a_cache_that_does_not_fit_the_weight_is_an_error():
    layer = tnn.Linear(HIDDEN, FFN)
    x = torch.randn(16, HIDDEN)
    with fp8_autocast():
        layer(x, is_first_microbatch=True)
    with fp8_autocast():
        layer(x, is_first_microbatch=False)  # fits
    cache = layer.fp8_scaling["gemm"].weight_cache
    cache.data = cache.data[:16]  # as if the weight had been replaced by one of another shape
    with pytest.raises(ValueError, match=r"cached FP8 weight \(torch.float8_e4m3fn, \(16, 32\), cpu\) does not fit "
                                         r"this call's weight \(torch.float8_e4m3fn, \(64, 32\), cpu\)"):
        with fp8_autocast():
            layer(x, is_first_microbatch=False)


def test_outside_fp8_and_in_calibration_the_argument_has_no_effect():
    layer = tnn.Linear(HIDDEN, FFN)
    x = torch.randn(16, HIDDEN)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x, is_first_microbatch=False), want)  # no autocast: no cache needed
    with fp8_autocast(enabled=False):
        assert torch.equal(layer(x, is_first_microbatch=False), want)
    state = layer.fp8_scaling["gemm"]
    with fp8_autocast(enabled=False, calibrating=True):
        assert torch.equal(layer(x, is_first_microbatch=False), want)
    assert state.weight.amax_history[1].item() == pytest.approx(layer.weight.abs().max().item(), rel=1e-6)
    assert state.weight_cache is None
    with fp8_autocast(enabled=False, calibrating=True):
        layer(x, is_first_microbatch=True)
    assert state.weight_cache is None


@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_is_first_microbatch_must_be_none_or_a_bool(value):
    layer = tnn.Linear(HIDDEN, FFN)
    with pytest.raises(ValueError, match=f"is_first_microbatch must be None, True or False; got {value!r}"):
        layer(torch.randn(16, HIDDEN), is_first_microbatch=value)
