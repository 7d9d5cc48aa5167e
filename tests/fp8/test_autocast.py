"""fp8_autocast with tachyon's modules: delayed scaling across steps, the FP8 forward and backward
against an explicit emulation, nesting, calibration, the backward-inside-autocast error, the
multiple-of-16 rule, state_dict round trips, and FP8 outputs/gradients against bf16."""

from __future__ import annotations

import io

import pytest
import torch

import tachyon
import tachyon.nn as tnn
from tachyon.fp8 import (
    DelayedScaling, Format, cast_to_fp8, current_settings, decode_extra_state, fp8_autocast, is_fp8_enabled,
)
from tests.utils import assert_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _q(t: torch.Tensor, scale: float, dtype=E4M3) -> torch.Tensor:
    """What an FP8 operand holds after the cast and dequantization: fp8(t * scale) / scale, in fp32."""
    s = torch.tensor(float(scale))
    return cast_to_fp8(t, s, dtype).float() * (1.0 / s)


def _amax(t: torch.Tensor) -> float:
    return t.detach().abs().max().item()


def test_lazy_top_level_name_and_enabled_flag():
    assert tachyon.fp8_autocast is fp8_autocast
    assert not is_fp8_enabled()
    with fp8_autocast():
        assert is_fp8_enabled()
        with fp8_autocast(enabled=False):
            assert not is_fp8_enabled()
        assert is_fp8_enabled()
    assert not is_fp8_enabled()


def test_outside_autocast_modules_run_in_high_precision_and_leave_the_state_alone():
    layer = tnn.Linear(32, 16)
    x = torch.randn(16, 32)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    state = layer.fp8_scaling["gemm"]
    assert state.input.amax_history.abs().sum() == 0 and state.input.scale.item() == 1.0


def test_delayed_scaling_step_t_casts_with_the_scale_from_steps_before_t():
    layer = tnn.Linear(32, 16)
    with torch.no_grad():
        layer.bias.normal_()
    w, b = layer.weight.detach(), layer.bias.detach()
    state = layer.fp8_scaling["gemm"]
    x1, x2 = 3 * torch.randn(16, 32), torch.randn(2, 8, 32)
    with fp8_autocast():
        y1 = layer(x1)
        assert state.input.scale.item() == 1.0  # not updated before the autocast exits
    assert_close(y1, _q(x1, 1) @ _q(w, 1).t() + b, name="step 1 (scale 1)")
    s_x, s_w = 448.0 / _amax(x1), 448.0 / _amax(w)
    assert state.input.scale.item() == pytest.approx(s_x, rel=1e-6)
    assert state.weight.scale.item() == pytest.approx(s_w, rel=1e-6)
    assert state.input.scale_inv.item() == pytest.approx(1 / s_x, rel=1e-6)
    with fp8_autocast():
        y2 = layer(x2)
    assert y2.shape == (2, 8, 16)
    # step 2 is cast with step 1's scales, although x2's own amax is smaller
    assert_close(y2, _q(x2, s_x) @ _q(w, s_w).t() + b, name="step 2 (step 1's scales)")
    assert state.input.amax_history[:3].tolist() == pytest.approx([0.0, _amax(x2), _amax(x1)], rel=1e-6)
    assert state.input.scale.item() == pytest.approx(s_x, rel=1e-6)  # "max" over the history: still x1's


@pytest.mark.parametrize("fmt,grad_dtype", [(Format.HYBRID, E5M2), (Format.E4M3, E4M3)], ids=["HYBRID", "E4M3"])
def test_fp8_backward_uses_the_forward_scales_and_its_own_grad_scaling(fmt, grad_dtype):
    recipe = DelayedScaling(fp8_format=fmt)
    layer = tnn.Linear(32, 48)
    state = layer.fp8_scaling["gemm"]
    w = layer.weight.detach()
    grad_max = 57344.0 if grad_dtype == E5M2 else 448.0
    s_x = s_w = s_g = 1.0
    for step in range(2):
        x = (torch.randn(32, 32) * (step + 1)).requires_grad_()  # growing amax: every exit changes the scale
        g = torch.randn(32, 48) * (step + 1)
        with fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        assert state.input.scale.item() != s_x  # the exit updated the scale: backward must not use it
        y.backward(g)
        x8, w8, g8 = _q(x.detach(), s_x), _q(w, s_w), _q(g, s_g, grad_dtype)
        assert_close(x.grad, g8 @ w8, name=f"dx (step {step})")
        assert_close(layer.weight.grad, g8.t() @ x8, atol=1e-4, name=f"dweight (step {step})")
        assert_close(layer.bias.grad, g.sum(0), atol=1e-4, name=f"dbias (step {step})")
        layer.zero_grad()
        # grad_output's scale is updated at the end of the backward, from its own history
        assert state.grad_output.amax_history[1].item() == pytest.approx(_amax(g), rel=1e-6)
        s_g = grad_max / max(state.grad_output.amax_history.max().item(), 1e-30)
        assert state.grad_output.scale.item() == pytest.approx(s_g, rel=1e-6)
        s_x, s_w = state.input.scale.item(), state.weight.scale.item()


def test_nested_autocast_inner_settings_win_and_scales_update_at_the_outermost_exit():
    fp8_layer, plain_layer = tnn.Linear(32, 16), tnn.Linear(32, 16)
    x = 5 * torch.randn(16, 32)
    with fp8_autocast(fp8_recipe=DelayedScaling(margin=1)):
        with fp8_autocast(enabled=False):
            y_plain = plain_layer(x)
        with fp8_autocast(fp8_recipe=DelayedScaling(margin=2)):
            y_fp8 = fp8_layer(x)
        assert fp8_layer.fp8_scaling["gemm"].input.scale.item() == 1.0  # the inner exit did not update
    assert torch.equal(y_plain, torch.nn.functional.linear(x, plain_layer.weight, plain_layer.bias))
    assert plain_layer.fp8_scaling["gemm"].input.amax_history.abs().sum() == 0
    assert not torch.allclose(y_fp8, torch.nn.functional.linear(x, fp8_layer.weight, fp8_layer.bias), rtol=1e-3)
    # the innermost recipe (margin=2) was recorded with the GEMM
    assert fp8_layer.fp8_scaling["gemm"].input.scale.item() == pytest.approx(448.0 / _amax(x) / 4, rel=1e-6)


def test_calibrating_without_fp8_records_amaxes_with_high_precision_numerics():
    layer = tnn.LayerNormLinear(32, 16, return_layernorm_output=True)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(16, 16)
    want, _ = layer(x)
    with fp8_autocast(enabled=False, calibrating=True):
        got, ln_out = layer(x)
    assert_close(got, want, name="calibration output")  # no FP8 rounding
    got.backward(g)
    state = layer.fp8_scaling["gemm"]
    s_x, s_w = 448.0 / _amax(ln_out), 448.0 / _amax(layer.weight)
    assert state.input.scale.item() == pytest.approx(s_x, rel=1e-6)
    assert state.weight.scale.item() == pytest.approx(s_w, rel=1e-6)
    assert state.grad_output.scale.item() == pytest.approx(57344.0 / _amax(g), rel=1e-6)
    # the next FP8 step starts from the calibrated scales
    with fp8_autocast():
        y, _ = layer(x)
    want = _q(ln_out.detach(), s_x) @ _q(layer.weight.detach(), s_w).t() + layer.bias.detach()
    assert_close(y, want, name="first FP8 step after calibration")


@pytest.mark.parametrize("enabled,calibrating", [(True, False), (False, True), (True, True)])
def test_enabled_decides_the_numerics_and_calibrating_adds_recording(enabled, calibrating):
    """Transformer Engine's rule for the four (enabled, calibrating) combinations (the fourth,
    both False, is the next test): FP8 numerics exactly when enabled; amaxes recorded and scales
    updated when enabled or calibrating."""
    layer = tnn.Linear(32, 16)
    with torch.no_grad():
        layer.bias.normal_()
    w, b = layer.weight.detach(), layer.bias.detach()
    state = layer.fp8_scaling["gemm"]
    x = 3 * torch.randn(16, 32)
    with fp8_autocast(enabled=enabled, calibrating=calibrating):
        settings = current_settings()
        assert (settings.fp8, settings.records, is_fp8_enabled()) == (enabled, True, enabled)
        y = layer(x)
    if enabled:  # FP8 numerics: operands cast with the current scales (1 in the first step)
        assert_close(y, _q(x, 1) @ _q(w, 1).t() + b, name="FP8 output")
        assert not torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-3)
    else:
        assert torch.equal(y, torch.nn.functional.linear(x, w, b))
    assert state.input.amax_history[1].item() == pytest.approx(_amax(x), rel=1e-6)
    assert state.weight.amax_history[1].item() == pytest.approx(_amax(w), rel=1e-6)
    assert state.input.scale.item() == pytest.approx(448.0 / _amax(x), rel=1e-6)


def test_neither_enabled_nor_calibrating_is_high_precision_without_recording():
    layer = tnn.LayerNormMLP(32, 64)
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(enabled=False, calibrating=False):
        settings = current_settings()
        assert (settings.fp8, settings.records, is_fp8_enabled()) == (False, False, False)
        y = layer(x)
    assert torch.equal(y, layer(x))
    y.sum().backward()  # backward after the exit: fine, and records nothing either
    for gemm in layer.fp8_scaling.values():
        for role in ("input", "weight", "grad_output"):
            state = getattr(gemm, role)
            assert state.amax_history.abs().sum() == 0 and state.scale.item() == 1.0, role


@pytest.mark.parametrize("enabled,calibrating", [(True, False), (False, True), (True, True)])
def test_backward_inside_fp8_autocast_raises(enabled, calibrating):
    layer = tnn.Linear(32, 16)
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(enabled=enabled, calibrating=calibrating):
        y = layer(x)
        with pytest.raises(RuntimeError, match="call backward outside fp8_autocast"):
            y.sum().backward()


@pytest.mark.parametrize("make,x_shape,name", [
    (lambda: tnn.Linear(24, 16), (16, 24), "in_features=24"),
    (lambda: tnn.Linear(32, 20), (16, 32), "out_features=20"),
    (lambda: tnn.Linear(32, 16), (2, 5, 32), "tokens=10"),
    (lambda: tnn.LayerNormLinear(32, 8), (16, 32), "out_features=8"),
    (lambda: tnn.LayerNormMLP(32, 40), (16, 32), "out_features=40"),
], ids=["in", "out", "tokens", "lnlinear", "mlp-ffn"])
def test_dimensions_not_multiple_of_16_raise_in_fp8_only(make, x_shape, name):
    module = make()
    x = torch.randn(x_shape)
    module(x)  # fine outside FP8
    with fp8_autocast(enabled=False, calibrating=True):
        module(x)  # and in calibration (high precision)
    with pytest.raises(ValueError, match=f"{name} is not a multiple of 16; FP8 GEMMs need every dimension"):
        with fp8_autocast():
            module(x)


def test_a_failing_forward_discards_the_steps_scale_updates():
    layer = tnn.Linear(32, 16)
    with pytest.raises(ZeroDivisionError):
        with fp8_autocast():
            layer(torch.randn(16, 32))
            1 / 0
    assert layer.fp8_scaling["gemm"].input.scale.item() == 1.0
    with fp8_autocast():  # and the next step works and updates
        layer(torch.randn(16, 32))
    assert layer.fp8_scaling["gemm"].input.scale.item() != 1.0


def _train_steps(module, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
        with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
            y = module(x)
        y.backward(torch.randn(y.shape, generator=gen))


def test_state_dict_round_trip_restores_the_scaling_state_exactly():
    mlp = tnn.LayerNormMLP(32, 64, activation="swiglu")
    _train_steps(mlp, 3, seed=1)
    buffer = io.BytesIO()
    torch.save(mlp.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    restored = tnn.LayerNormMLP(32, 64, activation="swiglu")
    restored.load_state_dict(loaded)
    for gemm in ("fc1", "fc2"):
        for role in ("input", "weight", "grad_output"):
            a, b = getattr(mlp.fp8_scaling[gemm], role), getattr(restored.fp8_scaling[gemm], role)
            for key in ("amax_history", "scale", "scale_inv"):
                assert torch.equal(getattr(a, key), getattr(b, key)), f"{gemm}.{role}.{key}"
            assert a.amax_history.abs().sum() > 0
    # the state_dict is a snapshot, and training on from either module gives identical results
    assert loaded["_extra_state"].dtype == torch.uint8  # a tensor (safetensors takes it), decoded by:
    snapshot = decode_extra_state(loaded["_extra_state"])["gemms"]["fc1"]["input"]["scale"].clone()
    _train_steps(mlp, 2, seed=2)
    _train_steps(restored, 2, seed=2)
    assert torch.equal(decode_extra_state(loaded["_extra_state"])["gemms"]["fc1"]["input"]["scale"], snapshot)
    x = torch.randn(16, 32)
    with fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=4)):
        assert torch.equal(mlp(x), restored(x))


def test_set_extra_state_rejects_foreign_state():
    layer = tnn.Linear(32, 16)
    with pytest.raises(ValueError, match="_extra_state must be a dict with 'gemms'"):
        layer.set_extra_state(io.BytesIO())
    with pytest.raises(ValueError, match="_extra_state must be a 1-D uint8 tensor"):
        layer.set_extra_state(torch.zeros(3))
    with pytest.raises(ValueError, match="_extra_state bytes do not hold a saved FP8 state"):
        layer.set_extra_state(torch.arange(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"FP8 state names unknown GEMMs \['fc1'\]; this module has \['gemm'\]"):
        layer.set_extra_state({"gemms": {"fc1": {}}})


def _normalized(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return t.float() / ref.float().abs().max()


MODULES = {
    "Linear": lambda: tnn.Linear(64, 48, params_dtype=torch.bfloat16),
    "LayerNormLinear": lambda: tnn.LayerNormLinear(64, 48, params_dtype=torch.bfloat16),
    "LayerNormMLP-RMSNorm": lambda: tnn.LayerNormMLP(64, 96, normalization="RMSNorm", params_dtype=torch.bfloat16),
    **{f"LayerNormMLP-{a}": (lambda a=a: tnn.LayerNormMLP(64, 96, activation=a, params_dtype=torch.bfloat16))
       for a in ("gelu", "geglu", "swiglu", "relu", "silu", "qgelu")},
}


@pytest.mark.parametrize("name", list(MODULES))
def test_fp8_outputs_and_gradients_match_bf16_within_fp8_tolerance(name, monkeypatch):
    """FP8 error is relative to each tensor's amax (one scale per tensor), so outputs and gradients
    are compared after dividing both by the bf16 result's amax: forward with the E4M3 tolerance,
    gradients (E5M2 grad_output under HYBRID) with the E5M2 tolerance.

    ReLU's derivative jumps at 0: pre-activations within FP8 rounding of 0 switch a unit's gradient
    on or off, an O(1) change per unit that the backward spreads over whole rows. So for ReLU the
    bf16 reference backpropagates through the FP8 run's ReLU mask (its forward is unaffected).
    """
    module = MODULES[name]()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    g = torch.randn(2, 16, module(x).shape[-1], dtype=torch.bfloat16)

    def run(**autocast):
        xx = x.clone().requires_grad_()
        if autocast:
            with fp8_autocast(**autocast):
                y = module(xx)
        else:
            y = module(xx)
        grads = torch.autograd.grad(y, [xx, *module.parameters()], g)
        return [y, *grads]

    run(enabled=False, calibrating=True)  # calibrate the scales (as one would before FP8 training)
    relu_masks = []
    if name.endswith("relu"):
        import tachyon.nn.layernorm_mlp as mlp_module

        activation = mlp_module.te_activation

        def record_mask(h, bias, act, backend):
            relu_masks.append((h.float() + bias.float()) > 0)
            return activation(h, bias, act, backend)

        monkeypatch.setattr(mlp_module, "te_activation", record_mask)
        got = run(enabled=True)
        monkeypatch.setattr(mlp_module, "te_activation", lambda h, bias, act, backend: (h + bias) * relu_masks[0])
        want = run()
    else:
        got = run(enabled=True)
        want = run()
    names = ["out", "dx"] + [f"d{n}" for n, _ in module.named_parameters()]
    for n, a, e in zip(names, got, want):
        assert a.dtype == torch.bfloat16
        assert_close(_normalized(a, e), _normalized(e, e), dtype=E4M3 if n == "out" else E5M2, name=n)
    assert not torch.equal(got[0], want[0])  # FP8 numerics did run


@pytest.mark.gpu
def test_native_fp8_linear_on_gpu_matches_the_cpu_emulation():
    """torch._scaled_mm (compute capability >= 8.9) and the CPU emulation cast the same FP8 operands;
    they differ only in the fp32 accumulation order, so the bf16 tolerance holds for output and
    every gradient, over two steps (the second with adapted scales)."""
    from tachyon.fp8 import native_fp8_supported

    if not native_fp8_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9) for torch._scaled_mm")
    cpu = tnn.Linear(64, 48, params_dtype=torch.bfloat16)
    gpu = tnn.Linear(64, 48, params_dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    for step in range(2):
        x = torch.randn(32, 64, dtype=torch.bfloat16)
        g = torch.randn(32, 48, dtype=torch.bfloat16)
        results = []
        for module, device in ((cpu, "cpu"), (gpu, "cuda")):
            xx = x.to(device).requires_grad_()
            with fp8_autocast():
                y = module(xx)
            results.append([y, *torch.autograd.grad(y, [xx, module.weight, module.bias], g.to(device))])
        for n, a, e in zip(["out", "dx", "dweight", "dbias"], results[1], results[0]):
            assert_close(a.cpu(), e, name=f"{n} (step {step})")
    for role in ("input", "weight", "grad_output"):
        a, b = getattr(gpu.fp8_scaling["gemm"], role), getattr(cpu.fp8_scaling["gemm"], role)
        assert a.scale.device.type == "cuda"
        assert_close(a.scale.cpu(), b.scale, name=f"{role} scale")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_fp8_on_gpu_matches_the_cpu_emulation(activation):
    """On the GPU the norm and activation run as Triton kernels and the GEMMs natively (or emulated
    below compute capability 8.9): within the FP8 tolerances of the CPU emulation (output E4M3,
    gradients E5M2, amax-normalized as in the bf16 comparison above)."""
    cpu = tnn.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16)
    gpu = tnn.LayerNormMLP(64, 96, activation=activation, params_dtype=torch.bfloat16, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    g = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    results = []
    for module, device in ((cpu, "cpu"), (gpu, "cuda")):
        with fp8_autocast(enabled=False, calibrating=True):
            module(x.to(device))
        xx = x.to(device).requires_grad_()
        with fp8_autocast():
            y = module(xx)
        results.append([y, *torch.autograd.grad(y, [xx, *module.parameters()], g.to(device))])
    names = ["out", "dx"] + [f"d{n}" for n, _ in cpu.named_parameters()]
    for n, a, e in zip(names, results[1], results[0]):
        assert_close(_normalized(a.cpu(), e), _normalized(e, e), dtype=E4M3 if n == "out" else E5M2, name=n)


def test_one_backward_pass_updates_every_grad_scale_in_one_call(monkeypatch):
    """The grad_output states of all FP8 GEMMs a backward pass ran are updated together when the
    pass ends (one update_scales call, so one amax all-reduce per fp8_group), each from its own
    amax; a GEMM run twice in the pass records the larger amax and updates once."""
    import tachyon.fp8.pending as fp

    calls = []
    real = fp.update_scales
    monkeypatch.setattr(fp, "update_scales", lambda items: calls.append(len(items)) or real(items))
    first, shared, last = tnn.Linear(16, 16), tnn.Linear(16, 16), tnn.Linear(16, 16)
    x = torch.randn(16, 16, requires_grad=True)
    seen = {}
    for name, layer in (("first", first), ("shared", shared), ("last", last)):
        layer.register_full_backward_hook(lambda m, gi, go, name=name: seen.setdefault(name, []).append(go[0].abs().max().item()))
    with fp8_autocast():
        h = shared(first(x))
        y = last(shared(h * 3))  # `shared` runs twice in the pass
    y.backward(torch.randn(16, 16) * 5)
    assert calls == [6, 3]  # the autocast's exit: 3 inputs + 3 weights; the backward's end: 3 grad_outputs
    for name, layer in (("first", first), ("shared", shared), ("last", last)):
        history = layer.fp8_scaling["gemm"].grad_output.amax_history
        assert history[0].item() == 0.0 and history[2].item() == 0.0  # rolled once
        assert history[1].item() == pytest.approx(max(seen[name]), rel=1e-6)
    assert len(seen["shared"]) == 2 and seen["shared"][0] != pytest.approx(seen["shared"][1], rel=0.05)


def test_grad_scales_still_update_after_a_backward_pass_that_raised():
    """A backward pass that fails after an FP8 GEMM's backward never reaches its end: the next
    pass must still update that GEMM's grad_output scale (its pending update is not lost for good)."""

    class FailOnce(torch.autograd.Function):
        fail = True

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if FailOnce.fail:
                FailOnce.fail = False
                raise RuntimeError("planted")
            return g

    layer = tnn.Linear(16, 16)
    history = layer.fp8_scaling["gemm"].grad_output.amax_history
    for attempt in range(2):
        x = torch.randn(16, 16, requires_grad=True)
        with fp8_autocast():
            y = layer(FailOnce.apply(x))  # FailOnce's backward runs after the GEMM's
        if attempt == 0:
            with pytest.raises(RuntimeError, match="planted"):
                y.backward(torch.randn(16, 16))
            assert history[0].item() > 0  # recorded, not yet updated
        else:
            y.backward(torch.randn(16, 16))
    assert history[0].item() == 0.0 and history[1].item() > 0, history  # updated at the second pass's end
