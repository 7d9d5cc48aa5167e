"""The op registry: every fused op is a torch.library custom op, and in plain eager mode the call
runs the implementation directly (an autograd.Function with the op's own setup_context and
backward) with the same results and the same saved tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tachyon.kernels import registry
from tachyon.kernels.attention import attention
from tachyon.kernels.dropout import bias_dropout_add_layer_norm
from tachyon.kernels.layernorm import layer_norm


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


CASES = {
    "layer_norm": lambda x: layer_norm(x, torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]), residual=x * 0.5,
                                       backend="torch"),
    "bias_dropout_add_layer_norm": lambda x: bias_dropout_add_layer_norm(
        x, torch.zeros(x.shape[-1]), x.detach() * 2, torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]), 1e-5, 0.3,
        1234, backend="torch")[0],
    "attention": lambda x: attention(x.view(2, 3, 5, 4), x.view(2, 3, 5, 4) * 0.5, x.view(2, 3, 5, 4).flip(-1),
                                     causal=True, dropout_p=0.2, seed=7, backend="torch").reshape(x.shape),
}


@pytest.mark.parametrize("name", list(CASES))
def test_eager_path_equals_the_custom_op_path(name, monkeypatch):
    """The same op through the direct eager path and through the dispatcher: outputs, input
    gradients and bytes saved for backward identical."""
    fn = CASES[name]
    results = {}
    for path in ("eager", "custom op"):
        monkeypatch.setattr(registry, "eager_call", (lambda args: True) if path == "eager" else (lambda args: False))
        x = torch.randn(2, 3, 20, generator=torch.Generator().manual_seed(0)).reshape(6, 20).requires_grad_()
        out, saved = _saved_bytes(lambda: fn(x))
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results[path] = (out.detach(), x.grad, saved)
    (out_a, dx_a, saved_a), (out_b, dx_b, saved_b) = results["eager"], results["custom op"]
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    assert saved_a == saved_b > 0


def test_eager_calls_skip_the_dispatcher_and_other_calls_use_it(monkeypatch):
    """Plain eager calls never reach the custom op; under a dispatch mode (FakeTensorMode here, as
    torch.compile's tracing uses) or with a tensor subclass the custom op runs."""
    from tachyon.kernels.layernorm import op as layernorm_op

    calls = []
    original = layernorm_op._norm_fwd.custom_op

    class Spy:
        def __call__(self, *args):
            calls.append(len(args))
            return original(*args)

    monkeypatch.setattr(layernorm_op._norm_fwd, "custom_op", Spy())
    x = torch.randn(4, 8, requires_grad=True)
    layer_norm(x, torch.ones(8), None, backend="torch").sum().backward()
    with torch.no_grad():
        layer_norm(x, torch.ones(8), None, backend="torch")
    assert calls == [], "eager calls went through the dispatcher"
    assert registry.eager_call((x, torch.nn.Parameter(torch.ones(2)), 1.0, None, "torch"))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(4, 8))
        assert not registry.eager_call((fake,))
        y = layer_norm(fake, torch.ones(8), None, backend="torch")
    assert calls and tuple(y.shape) == (4, 8)


def test_torch_compile_still_traces_the_custom_op():
    """Under torch.compile the op is the opaque custom op (one graph, no break), with gradients."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    traced = []

    def aot_eager_recording_ops(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    weight = torch.ones(16, requires_grad=True)

    def f(x):
        return layer_norm(x, weight, None, backend="torch").square().sum()

    compiled = torch.compile(f, backend=aot_eager_recording_ops, fullgraph=True)
    x = torch.randn(8, 16, requires_grad=True)
    compiled(x).backward()
    want = torch.autograd.grad(f(x), x)[0]
    assert torch.allclose(x.grad, want, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1
    # the graph holds the custom op itself, not the eager path's autograd.Function
    assert "tachyon.norm_fwd.default" in traced, f"ops in the compiled graph: {traced}"
