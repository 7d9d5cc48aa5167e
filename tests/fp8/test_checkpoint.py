"""Activation checkpointing under fp8_autocast: a checkpointed region is recomputed with the autocast
settings and scales of its forward, recording nothing twice, so outputs, input and parameter
gradients, amax histories and scales equal the run without checkpointing bit for bit -- through
tachyon.checkpointing (checkpoint, checkpoint_sequential, nested regions) and through
torch.utils.checkpoint with ``context_fn=tachyon.fp8.fp8_checkpoint_context_fn()``."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import tachyon.nn as tnn
from tachyon.engine import activation_checkpointing as ckpt
from tachyon.fp8 import DelayedScaling, autocast_active, fp8_autocast, fp8_checkpoint_context_fn, recomputing

HIDDEN, FFN, HEADS, SEQ, BATCH = 32, 64, 2, 8, 2
RECIPE = DelayedScaling(amax_history_len=4)
ROLES = ("input", "weight", "grad_output")


class Stack(torch.nn.Module):
    """Two TransformerLayers (dropout on) and a LayerNormMLP; ``mode`` picks the checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([
            tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1),
            tnn.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1, activation="swiglu"),
            tnn.LayerNormMLP(HIDDEN, FFN),
        ])

    def forward(self, x: torch.Tensor, mode: str = "plain") -> torch.Tensor:
        layers = list(self.layers)
        if mode == "sequential":  # 2 checkpointed segments of 1 layer, the last layer plain
            return ckpt.checkpoint_sequential(layers, 3, x)
        if mode == "nested":  # one region around layers 0-1, each also its own region, then the MLP
            def outer(h):
                for layer in layers[:2]:
                    h = ckpt.checkpoint(layer, h)
                return h

            return layers[2](ckpt.checkpoint(outer, x))
        for layer in layers:
            if mode == "every_layer":
                x = ckpt.checkpoint(layer, x)
            elif mode == "torch":
                x = torch_checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=fp8_checkpoint_context_fn())
            elif mode == "naive":  # the control: re-enter the autocast in the recompute, nothing more
                x = torch_checkpoint.checkpoint(layer, x, use_reentrant=False, context_fn=_naive_contexts)
            else:
                x = layer(x)
        return x


def _naive_contexts():
    return contextlib.nullcontext(), fp8_autocast(fp8_recipe=RECIPE)


def _run(model, mode, steps=2, autocast=True, **autocast_kwargs):
    """``steps`` training steps (fresh data each, the same in every mode); per step the output, the
    input gradient and every parameter gradient, and at the end the FP8 states."""
    gen = torch.Generator().manual_seed(7)
    results = []
    for step in range(steps):
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).mul_(step + 1).requires_grad_()
        g = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)  # dropout seeds
        context = fp8_autocast(fp8_recipe=RECIPE, **autocast_kwargs) if autocast else contextlib.nullcontext()
        with context:
            y = model(x, mode)
        y.backward(g)
        results.append({"out": y.detach(), "dx": x.grad, **{n: p.grad for n, p in model.named_parameters()}})
    return results, _states(model)


def _states(model):
    return {f"{prefix}.{name}.{role}.{key}": getattr(getattr(gemm, role), key).clone()
            for prefix, sub in model.named_modules() for name, gemm in getattr(sub, "fp8_scaling", {}).items()
            for role in ROLES for key in ("amax_history", "scale", "scale_inv")}


def _assert_identical(got, want):
    (got_steps, got_states), (want_steps, want_states) = got, want
    for step, (a, b) in enumerate(zip(got_steps, want_steps)):
        assert a.keys() == b.keys()
        for name in b:
            assert a[name] is not None and torch.equal(a[name], b[name]), f"step {step}: {name} differs"
    assert got_states.keys() == want_states.keys()
    for name in want_states:
        assert torch.equal(got_states[name], want_states[name]), f"{name}: {got_states[name]} != {want_states[name]}"


@pytest.fixture(scope="module")
def reference():
    """The model before training and its two plain (not checkpointed) FP8 steps."""
    torch.manual_seed(0)
    model = Stack()
    return model, _run(copy.deepcopy(model), "plain")


@pytest.mark.parametrize("mode", ["every_layer", "sequential", "nested", "torch"])
def test_checkpointed_fp8_training_equals_the_plain_run_bit_for_bit(reference, mode):
    model, plain = reference
    got = _run(copy.deepcopy(model), mode)
    _assert_identical(got, plain)
    scales = [v for k, v in got[1].items() if k.endswith(".scale")]
    assert all(s.item() != 1.0 for s in scales), "every GEMM really ran in FP8 with adapted scales"


def test_control_recomputing_in_the_autocast_with_the_updated_scales_is_not_the_same(reference):
    """What the snapshot prevents: a recompute that re-enters fp8_autocast but casts with the scales
    as they are in the backward (updated at the exit) gives other gradients, and records the
    amaxes again, into the next step's history slot."""
    model, (plain_steps, plain_states) = reference
    steps, states = _run(copy.deepcopy(model), "naive")
    assert torch.equal(steps[0]["out"], plain_steps[0]["out"])  # the forward itself is the same
    assert not torch.equal(steps[0]["dx"], plain_steps[0]["dx"])
    history = "layers.0.self_attention.layernorm_qkv.gemm.input.amax_history"
    assert not torch.equal(states[history], plain_states[history])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_without_the_context_fn_refuses_an_fp8_region(reentrant):
    """The reason for the context_fn: recomputed outside the autocast, the region would give
    high-precision activations for an FP8 forward. The FP8 GEMM refuses, naming the fix (the
    reentrant checkpoint takes no context_fn at all)."""
    mlp = tnn.LayerNormMLP(HIDDEN, FFN)
    x = torch.randn(16, HIDDEN, requires_grad=True)
    with fp8_autocast():
        y = torch_checkpoint.checkpoint(mlp, x, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="fp8_checkpoint_context_fn"):
        y.sum().backward()


def test_a_module_that_ran_fp8_still_runs_high_precision_forwards_and_backwards():
    """The refusal above only concerns recomputation inside a backward: after FP8 steps, a
    high-precision forward + backward of the same module is fine."""
    mlp = tnn.LayerNormMLP(HIDDEN, FFN)
    x = torch.randn(16, HIDDEN, requires_grad=True)
    with fp8_autocast():
        y = mlp(x)
    y.sum().backward()
    mlp(x).sum().backward()
    assert x.grad is not None


AUTOCASTS = {
    "outside any autocast": None,
    "opening its own autocast": None,
    "in calibration": {"enabled": False, "calibrating": True},
}


@pytest.mark.parametrize("how", list(AUTOCASTS))
def test_other_regions_equal_their_plain_run(how):
    """A region outside fp8_autocast is untouched (the FP8 state keeps its initial values); a region
    that opens fp8_autocast itself updates the scales once (its recompute's inner exit does not
    count as an outermost one); a calibration region (high precision + recording) records once."""
    torch.manual_seed(0)
    mlp = tnn.LayerNormMLP(HIDDEN, FFN, activation="geglu")
    own_autocast = how == "opening its own autocast"

    def region(module, h):
        if own_autocast:
            assert not autocast_active() or recomputing()
            with fp8_autocast(fp8_recipe=RECIPE):
                return module(h)
        return module(h)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x, mode):
            if mode == "plain":
                return region(self.module, x)
            return ckpt.checkpoint(region, self.module, x)

    kwargs = AUTOCASTS[how]
    autocast = kwargs is not None
    plain = _run(Wrapper(copy.deepcopy(mlp)), "plain", autocast=autocast, **(kwargs or {}))
    got = _run(Wrapper(copy.deepcopy(mlp)), "checkpointed", autocast=autocast, **(kwargs or {}))
    _assert_identical(got, plain)
    states = plain[1]
    if how == "outside any autocast":
        assert all(v.abs().sum() == 0 for k, v in states.items() if k.endswith("amax_history"))
        assert all(v.item() == 1.0 for k, v in states.items() if k.endswith("scale"))
    else:
        assert all(v.item() != 1.0 for k, v in states.items() if k.endswith(".scale"))


def test_cached_weights_and_a_second_backward_through_the_same_graph():
    """is_first_microbatch inside checkpointed regions (the recompute reuses exactly the weight the
    forward used), and a graph recomputed twice (retain_graph): the recompute context is entered
    once per recomputation."""
    torch.manual_seed(0)
    base = tnn.LayerNormMLP(HIDDEN, FFN)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(16, HIDDEN, generator=gen) for _ in range(3)]
    g = torch.randn(16, HIDDEN, generator=gen)
    results = []
    for checkpointed in (False, True):
        mlp = copy.deepcopy(base)
        grads = []
        for i, x in enumerate(xs):
            x = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=RECIPE):
                flag = i == 0
                y = ckpt.checkpoint(mlp, x, flag) if checkpointed else mlp(x, flag)
            first = torch.autograd.grad(y, [x, *mlp.parameters()], g, retain_graph=True)
            second = torch.autograd.grad(y, [x, *mlp.parameters()], g)
            grads.append((y.detach(), *first, *second))
        results.append((grads, _states(mlp)))
    for step, (a, b) in enumerate(zip(results[1][0], results[0][0])):
        for k, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"micro-batch {step}, tensor {k}"
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


def test_fp8_checkpoint_context_fn_combines_with_another_context_fn():
    entered = []

    @contextlib.contextmanager
    def note(tag):
        entered.append(tag)
        yield

    def other():
        return note("forward"), note("recompute")

    mlp = tnn.LayerNormMLP(HIDDEN, FFN)
    x = torch.randn(16, HIDDEN, requires_grad=True)
    with fp8_autocast():
        y = torch_checkpoint.checkpoint(mlp, x, use_reentrant=False, context_fn=fp8_checkpoint_context_fn(other))
    y.sum().backward()
    assert entered == ["forward", "recompute"]
    with pytest.raises(ValueError, match="context_fn must be a callable returning two context managers or None"):
        fp8_checkpoint_context_fn(3)


@pytest.mark.gpu
def test_checkpointed_fp8_with_cached_weights_on_gpu_matches_the_plain_run():
    """Native FP8 GEMMs (torch._scaled_mm on compute capability >= 8.9, emulated below) and Triton
    norm/activation kernels: checkpointed regions with cached weights against the plain run (the
    bf16 tolerance, in case a GPU kernel is not bitwise deterministic)."""
    from tests.utils import assert_close

    torch.manual_seed(0)
    base = tnn.LayerNormMLP(64, 128, params_dtype=torch.bfloat16, device="cuda")
    xs = [torch.randn(32, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    g = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    results = []
    for checkpointed in (False, True):
        mlp = copy.deepcopy(base)
        outs = []
        for i, x in enumerate(xs):
            x = x.clone().requires_grad_()
            with fp8_autocast(fp8_recipe=RECIPE):
                y = ckpt.checkpoint(mlp, x, i == 0) if checkpointed else mlp(x, i == 0)
            y.backward(g)
            outs += [y.detach(), x.grad]
        results.append(outs + [p.grad for p in mlp.parameters()] + list(_states(mlp).values()))
    for k, (got, want) in enumerate(zip(results[1], results[0])):
        assert_close(got.float(), want.float(), dtype=torch.bfloat16, name=f"tensor {k}")
