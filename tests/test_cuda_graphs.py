"""``tachyon.make_graphed_callables``: argument checks and refusals (CPU), and on a GPU (``-m gpu``)
replays equal to eager calls bit for bit, forward and backward, FP8 scales included."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import tachyon
from tachyon.cuda_graphs import make_graphed_callables

HAS_CUDA = torch.cuda.is_available()


def _layer():
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


@pytest.mark.parametrize("build,match", [
    (lambda: (_layer(), (torch.randn(2, 8),), {}), "CUDA"),
    (lambda: (_layer(), [torch.randn(2, 8)], {}), "must be a tuple"),
    (lambda: (_layer(), (torch.randn(2, 8), 3), {}), "only tensors"),
    (lambda: (_layer(), (torch.randn(2, 8),), {"sample_kwargs": [1]}), "must be a dict"),
    (lambda: (_layer(), (torch.randn(2, 8),), {"num_warmup_iters": 0}), "num_warmup_iters"),
    (lambda: (_layer(), (torch.randn(2, 8),), {"fp8_enabled": 1}), "fp8_enabled must be True or False"),
    (lambda: (_layer(), (torch.randn(2, 8),), {"fp8_weight_caching": True}), "needs fp8_enabled=True"),
    (lambda: (_layer(), (torch.randn(2, 8),), {"fp8_enabled": True, "fp8_weight_caching": True}),
     "is_first_microbatch"),
    (lambda: (_layer(), (torch.randn(2, 8),), {"sample_kwargs": {"progressive_layer_drop": True, "pld_theta": 0.5}}),
     "progressive layer drop"),
    (lambda: ((_layer(), _layer()), ((torch.randn(2, 8),),), {}), "2 callables but 1 sample_args"),
    (lambda: ((_layer(), _layer().eval()), ((torch.randn(2, 8),), (torch.randn(2, 8),)), {}), "all be in training mode"),
    (lambda: ("not callable", (torch.randn(2, 8),), {}), "not a module or function"),
])
def test_bad_arguments_are_refused_before_any_capture(build, match):
    module, args, kwargs = build()
    with pytest.raises(ValueError, match=match):
        make_graphed_callables(module, args, **kwargs)


def test_modules_with_hooks_or_trainable_buffers_are_refused():
    layer = _layer()
    layer[0].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks registered"):
        make_graphed_callables(layer, (torch.randn(2, 8),))
    layer = _layer()
    layer.register_buffer("scale", torch.ones(1, requires_grad=True))
    with pytest.raises(ValueError, match="buffers that require grad"):
        make_graphed_callables(layer, (torch.randn(2, 8),))


def test_refused_inside_an_open_autocast_and_with_a_recipe_this_machine_lacks():
    """The captures open their own autocast (so each replay updates delayed scales itself): inside
    one the call is refused; a recipe the autocast refuses is refused before the CUDA check."""
    from tachyon.fp8 import MXFP8BlockScaling

    with tachyon.autocast(enabled=False), pytest.raises(RuntimeError, match="inside an open tachyon.autocast"):
        make_graphed_callables(_layer(), (torch.randn(2, 8),))
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="MXFP8BlockScaling needs a GPU of compute capability 10"):
            make_graphed_callables(_layer(), (torch.randn(2, 8),), fp8_enabled=True, fp8_recipe=MXFP8BlockScaling())


def test_the_names_a_transformer_engine_script_uses():
    import tachyon.compat.transformer_engine.pytorch as te

    assert te.make_graphed_callables is tachyon.make_graphed_callables is make_graphed_callables


# --- on a GPU ----------------------------------------------------------------------------------

def _twins(make):
    torch.manual_seed(0)
    eager = make()
    graphed = copy.deepcopy(eager)
    return eager, graphed


def _steps(module, inputs, grads, ctx=contextlib.nullcontext, **kwargs):
    """Forward (inside ``ctx()``) and backward (outside it, as an FP8 autocast requires) per input."""
    out = []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        with ctx():
            y = module(x, **kwargs)
        y.backward(g)
        out.append([y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in module.parameters())])
        module.zero_grad(set_to_none=True)
    return out


def _assert_bitwise(a_steps, b_steps):
    for step, (a, b) in enumerate(zip(a_steps, b_steps)):
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"step {step}, tensor {i}: max diff {(u.float() - v.float()).abs().max().item()}"


@pytest.mark.gpu
@pytest.mark.parametrize("pre_ln", [True, False])
def test_graphed_bert_kernel_layer_equals_eager_bit_for_bit(pre_ln):
    """Dropout on: the layer's device-side dropout counter advances in the graph as in eager calls."""
    config = tachyon.TransformerKernelConfig(batch_size=4, max_seq_length=128, hidden_size=256, intermediate_size=1024,
                                             heads=4, attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                                             num_hidden_layers=2, initializer_range=0.02, seed=7, pre_layer_norm=pre_ln,
                                             bf16=True)
    eager, graphed = _twins(lambda: tachyon.TransformerKernelLayer(config).cuda())
    graphed.layer_id, graphed.dropout_seed = eager.layer_id, eager.dropout_seed
    inputs = [torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grads = [torch.randn_like(x) for x in inputs]
    make_graphed_callables(graphed, (inputs[0].clone().requires_grad_(),))
    _assert_bitwise(_steps(graphed, inputs, grads), _steps(eager, inputs, grads))


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block"])
def test_graphed_transformer_layer_with_fp8_equals_eager_including_scales(recipe_name):
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    recipe = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling,
              "block": Float8BlockScaling}[recipe_name]()
    eager, graphed = _twins(lambda: tachyon.nn.TransformerLayer(256, 1024, 4, hidden_dropout=0.0,
                                                                attention_dropout=0.0, params_dtype=torch.bfloat16).cuda())
    inputs = [torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grads = [torch.randn_like(x) for x in inputs]
    make_graphed_callables(graphed, (inputs[0].clone().requires_grad_(),), fp8_enabled=True, fp8_recipe=recipe)
    got = _steps(graphed, inputs, grads)
    want = _steps(eager, inputs, grads, ctx=lambda: tachyon.autocast(enabled=True, recipe=recipe))
    _assert_bitwise(got, want)
    for (name, a), (_, b) in zip(eager.named_modules(), graphed.named_modules()):
        for key, scaling in (getattr(a, "fp8_scaling", None) or {}).items():
            other = graphed.get_submodule(name).fp8_scaling[key]
            for role in ("input", "weight", "grad_output"):
                assert torch.equal(getattr(scaling, role).scale, getattr(other, role).scale), (name, key, role)
                assert torch.equal(getattr(scaling, role).amax_history, getattr(other, role).amax_history)


@pytest.mark.gpu
def test_auto_chooses_by_gpu_time_inside_the_graph_and_by_eager_time_outside():
    """tachyon.kernels.dispatch on an sm_90 GPU: bf16 LayerNorm at width 1024 is torch's op eagerly
    and the Triton kernel in a graph (measured faster there); each bit for bit its implementation."""
    from tachyon.kernels import dispatch
    from tachyon.kernels.layernorm import layer_norm

    if dispatch.arch_of(torch.empty(0, device="cuda")) != "sm_90":
        pytest.skip("the measured table covers sm_90")
    norm = tachyon.nn.LayerNorm(1024, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
        kernel = layer_norm(x, norm.weight, norm.bias, backend="triton")
        twin = torch.nn.functional.layer_norm(x, (1024,), norm.weight, norm.bias, norm.eps)
    assert not torch.equal(kernel, twin)  # told apart by their rounding
    assert torch.equal(norm(x).detach(), twin)
    graphed = make_graphed_callables(norm, (x.detach().clone().requires_grad_(),))
    assert torch.equal(graphed(x).detach(), kernel)


@pytest.mark.gpu
def test_graphed_function_and_shape_checks():
    w = torch.randn(8, 8, device="cuda", requires_grad=True)

    def f(x):
        return torch.tanh(x @ w)

    g = make_graphed_callables(f, (torch.randn(4, 8, device="cuda", requires_grad=True),))
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    y = g(x)
    assert torch.equal(y, f(x).detach())
    with pytest.raises(ValueError, match="captured for"):
        g(torch.randn(5, 8, device="cuda"))


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_captures_the_layer_in_cuda_graphs():
    """torch.compile(mode="reduce-overhead") runs tachyon's custom ops inside inductor's CUDA graphs:
    no cudagraph skip is counted, no recompile after the first step, and the values are eager's."""
    from torch._dynamo.utils import counters

    config = tachyon.TransformerKernelConfig(batch_size=4, max_seq_length=128, hidden_size=256, intermediate_size=1024,
                                             heads=4, attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0,
                                             num_hidden_layers=2, initializer_range=0.02, seed=7, bf16=True)
    eager, compiled_layer = _twins(lambda: tachyon.TransformerKernelLayer(config).cuda())
    compiled = torch.compile(compiled_layer, mode="reduce-overhead")
    counters.clear()
    inputs = [torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for x in inputs:
        got = compiled(x.clone().requires_grad_())
        got.sum().backward()
        want = eager(x.clone().requires_grad_())
        want.sum().backward()
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # forward (+ a backward graph)
