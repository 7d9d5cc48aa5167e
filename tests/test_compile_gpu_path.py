"""torch.compile over tachyon's GPU code path: no graph breaks, no recompiles, Triton kernels in the graph.

Two ways to run the GPU path on a CPU:

- ``StubLaunches`` (profiling/launch_stub.py): every host step of the CUDA path, Triton's launch
  stubbed. It needs Triton's GPU launch path, which this process (the interpreter) does not have,
  so those checks run in a subprocess without TRITON_INTERPRET. Each case compiles a layer or an
  op with ``torch.compile(backend="eager" / "aot_eager")``, runs 3 forward+backward steps of a
  fixed shape, and reports how many graphs dynamo handed the backend (1: one frame, compiled once,
  no graph break and no recompile), the graph breaks dynamo counted, and dynamo's warnings. With
  ``sm90=True`` backend "auto" answers as on an H100 (the ops' CUDA check and the GPU's compute
  capability patched, ``tachyon.kernels.dispatch.arch_of`` itself left as it is), so the dispatch
  table is consulted as on a GPU.
- Triton's interpreter (this process): the norm ops compiled with an AOT backend that keeps the
  forward and backward graphs, to check that the Triton kernels are in them
  (``triton_kernel_wrapper_functional``) and that the compiled results equal eager ones.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.utils.aot import run_without_interpreter

_SCRIPT = r'''
import contextlib, json, sys, warnings
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from tachyon.profiling.launch_stub import StubLaunches
import tachyon.nn as tnn
from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.kernels.layernorm import layer_norm, rms_norm
from tachyon.kernels.layernorm import op as norm_op
from tachyon.kernels.activation import bias_act
from tachyon.kernels.dropout import bias_dropout_add_layer_norm
from tachyon.kernels.attention import attention
from tachyon.kernels.linear import mlp
from tachyon.kernels import dispatch

CASES = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None  # [(name, backend, sm90), ...]
H, HEADS, FFN, B, S = 32, 2, 64, 2, 8
torch.manual_seed(0)


@contextlib.contextmanager
def on_sm90():
    """backend "auto" as on an sm_90 GPU: the ops' "is this CUDA" check and the CUDA capability query."""
    mods = [norm_op, sys.modules["tachyon.nn.transformer_layer_fused"], sys.modules["tachyon.kernels.attention.op"],
            sys.modules["tachyon.kernels.linear.mlp"]]
    real = [(m, m.auto_on_cuda) for m in mods]
    cuda = torch.cuda.get_device_capability, torch.cuda.current_device
    for m in mods:
        m.auto_on_cuda = lambda t, backend=None: backend in (None, "auto")
    torch.cuda.get_device_capability, torch.cuda.current_device = (lambda index=None: (9, 0)), (lambda: 0)
    dispatch._ARCHS.clear()
    try:
        yield
    finally:
        for m, f in real:
            m.auto_on_cuda = f
        torch.cuda.get_device_capability, torch.cuda.current_device = cuda
        dispatch._ARCHS.clear()


def kernel_layer(pre_ln):
    return TransformerKernelLayer(TransformerKernelConfig(
        batch_size=B, max_seq_length=S, hidden_size=H, intermediate_size=FFN, heads=HEADS, attn_dropout_ratio=0.1,
        hidden_dropout_ratio=0.1, num_hidden_layers=2, initializer_range=0.02, seed=1234, pre_layer_norm=pre_ln)).train()


def te_layer(one_node):
    layer = tnn.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1).train()
    layer.one_node_eager = one_node
    return layer


def case_fn(name):
    """A function of no arguments running one forward (its output is summed and differentiated)."""
    x = torch.randn(B * S, H, requires_grad=True)
    w, b = torch.randn(H, requires_grad=True), torch.randn(H, requires_grad=True)
    r = torch.randn(B * S, H, requires_grad=True)
    seed = torch.tensor(7)
    if name.startswith("TransformerKernelLayer"):
        layer = kernel_layer("pre-LN" in name)
        xs = torch.randn(B, S, H, requires_grad=True)
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, S // 2:] = 0
        return lambda: layer(xs, mask)
    if name.startswith("TransformerLayer"):
        layer = te_layer("one_node_eager=True" in name)
        xs = torch.randn(S, B, H, requires_grad=True)
        return lambda: layer(xs)
    q = torch.randn(B, HEADS, S, 16, requires_grad=True)
    w1, b1 = torch.randn(FFN, H, requires_grad=True), torch.randn(FFN, requires_grad=True)
    w2, b2 = torch.randn(H, FFN, requires_grad=True), torch.randn(H, requires_grad=True)
    return {
        "layer_norm": lambda: layer_norm(x, w, b),
        "layer_norm+residual": lambda: sum(layer_norm(x, w, b, r, return_residual=True)),
        "rms_norm": lambda: rms_norm(x, w),
        "bias_act": lambda: bias_act(x, b, "gelu"),
        "bias_dropout_add_layer_norm": lambda: bias_dropout_add_layer_norm(x, b, r, w, b, 1e-5, 0.1, seed)[0],
        "attention": lambda: attention(q, q, q, causal=True),
        "attention+dropout": lambda: attention(q, q, q, dropout_p=0.1, seed=seed),
        "mlp": lambda: mlp(x, w1, b1, "gelu", w2, b2),
    }[name]


def check(name, backend, steps=3):
    fn = case_fn(name)
    torch._dynamo.reset()
    counters.clear()
    graphs, aot_graphs = [], []
    if backend == "aot_eager":  # aot_eager, keeping the forward and backward graphs
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(gm, example_inputs):
            aot_graphs.append(gm)
            return make_boxed_func(gm.forward)

        inner = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    else:
        inner = torch._dynamo.lookup_backend(backend)

    def counting(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    compiled = torch.compile(fn, backend=counting)
    stub.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            compiled().float().sum().backward()
    breaks = {reason.splitlines()[0][:300]: n for reason, n in counters["graph_break"].items()}
    dynamo_warnings = sorted({str(w.message).splitlines()[0][:300] for w in caught if "_dynamo" in w.filename})
    nodes = [[n for n in g.graph.nodes if "triton_kernel_wrapper" in str(n.target)] for g in aot_graphs]
    return {"graphs": len(graphs), "breaks": breaks, "warnings": dynamo_warnings, "aot kernel nodes": [len(k) for k in nodes],
            "cloned": [n.kwargs.get("tensors_to_clone") for k in nodes for n in k], "launched": sorted(set(stub.names))}


results = {}
with StubLaunches() as stub:
    for name, backend, sm90 in CASES:
        with on_sm90() if sm90 else contextlib.nullcontext():
            results[f"{name} [{backend}{', sm_90' if sm90 else ''}]"] = check(name, backend)
    # the custom op called through the dispatcher on real tensors (what a dispatch mode sees): torch runs
    # the triton_op's implementation with wrap_triton off, so the launch is FastKernel's cached one
    from tachyon.kernels.layernorm import triton as norm_triton
    x, w = torch.randn(4, H), torch.randn(H)
    norm_op._norm_fwd.custom_op(x, w, None, None, 1e-5, False, False, "triton")
    before = (len(stub.launches), norm_triton._norm_fwd_kernel.cache_sizes())
    norm_op._norm_fwd.custom_op(x, w, None, None, 1e-5, False, False, "triton")
    results["dispatcher call"] = {"launches": len(stub.launches) - before[0],
                                  "fast entries": [before[1][1], norm_triton._norm_fwd_kernel.cache_sizes()[1]]}
print("RESULTS", json.dumps(results))
'''

LAYERS = ["TransformerKernelLayer pre-LN", "TransformerKernelLayer post-LN", "TransformerLayer one_node_eager=True",
          "TransformerLayer one_node_eager=False"]
TWIN_IN_FP32 = ("layer_norm", "layer_norm+residual", "rms_norm", "attention", "mlp")
OPS = ["layer_norm", "layer_norm+residual", "rms_norm", "bias_act", "bias_dropout_add_layer_norm", "attention",
       "attention+dropout", "mlp"]


def _run(cases: list[tuple[str, str, bool]]) -> dict:
    script = _SCRIPT.replace("json.loads(sys.argv[1]) if len(sys.argv) > 1 else None",
                             repr(json.dumps(cases)).join(("json.loads(", ")")))
    out = run_without_interpreter(script, timeout=600)
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULTS ")).removeprefix("RESULTS "))


def _key(name: str, backend: str, sm90: bool) -> str:
    return f"{name} [{backend}{', sm_90' if sm90 else ''}]"


def _assert_one_graph_each(results: dict, cases: list[tuple[str, str, bool]]) -> None:
    for case in cases:
        r = results[_key(*case)]
        # one graph for 3 steps: the frame compiled once, with no graph break and no recompile
        assert (r["graphs"], r["breaks"], r["warnings"]) == (1, {}, []), f"{_key(*case)}: {r}"
        # the GPU path ran (fp32 ops with a torch twin take it under "auto" on sm_90: not measured)
        assert r["launched"] or (case[2] and case[0] in TWIN_IN_FP32), f"{_key(*case)}: no Triton kernel launched"


# backend "auto" as on an H100 (the layers measured slower compiled than eager there), and one
# norm on the Triton backend (fp32 norms are not in the dispatch table: "auto" takes torch's twin)
_DEFAULT = [("TransformerKernelLayer pre-LN", "aot_eager", True), ("TransformerLayer one_node_eager=True", "aot_eager", True),
            ("attention+dropout", "eager", True), ("layer_norm+residual", "aot_eager", False)]


def test_compiled_gpu_path_has_one_graph_no_dynamo_warning_and_norm_kernels_in_the_graph():
    """Fails where a layer or op breaks the graph, recompiles between steps, or makes dynamo trace
    through a cache (before: dispatch.arch_of's lru_cache, a warning per compile); and where the
    norm's Triton kernels are not in the AOT graphs (before: one opaque custom op)."""
    results = _run(_DEFAULT)
    _assert_one_graph_each(results, _DEFAULT)
    norm = results[_key("layer_norm+residual", "aot_eager", False)]
    assert norm["aot kernel nodes"] == [1, 1], norm  # forward kernel; backward kernel
    assert norm["launched"] == ["_norm_bwd_kernel", "_norm_fwd_kernel"], norm  # the graph's kernels, launched
    # torch's analysis of the kernels (lowered for the sm_90 target) finds what each writes: only the
    # outputs are cloned, no input, and no two arguments alias
    assert norm["cloned"] == [["Y", "Z", "MEAN", "RSTD"], ["DX", "DW_PART", "DB_PART"]], norm
    # through the dispatcher on real tensors the launch stays the cached one: one launch, no new entry
    assert results["dispatcher call"]["launches"] == 1
    assert results["dispatcher call"]["fast entries"][0] == results["dispatcher call"]["fast entries"][1] >= 1


@pytest.mark.slow
def test_compiled_gpu_path_every_layer_and_op():
    cases = [(name, backend, sm90) for sm90 in (False, True) for name in LAYERS + OPS for backend in ("eager", "aot_eager")]
    results = _run(cases)
    _assert_one_graph_each(results, cases)
    for sm90 in (False, True):
        for name in ("layer_norm", "layer_norm+residual", "rms_norm"):
            r = results[_key(name, "aot_eager", sm90)]
            # Triton: the kernels in the graph; auto on sm_90: fp32 is not measured, torch's twin
            assert r["aot kernel nodes"] == ([0, 0] if sm90 else [1, 1]), (name, sm90, r)
    # the other ops on Triton: their kernels in the AOT graphs, and torch's analysis of the kernels
    # lowered for sm_90 clones only what each writes (its outputs: no input, no two aliasing arguments)
    attention = ([1, 2], [["OUT", "LSE"], ["DELTA", "DQ"], ["DK", "DV"]])
    for name, (nodes, cloned) in {
        "bias_act": ([1, 1], [["Y"], ["DX", "DB_PART"]]),
        "bias_dropout_add_layer_norm": ([1, 1], [["Y", "Z", "MEAN", "RSTD"],
                                                 ["DX", "DRES", "DW_PART", "DLNB_PART", "DB_PART"]]),
        "attention": attention, "attention+dropout": attention,
        "mlp": ([1, 1], [["OUT", "PRE"], ["OUT", "PART"]]),
    }.items():
        r = results[_key(name, "aot_eager", False)]
        assert (r["aot kernel nodes"], r["cloned"]) == (nodes, cloned), (name, r)


# ---- Triton's interpreter: the kernels in the compiled graph, results as eager ----

def _aot_capture():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep), graphs


def _triton_nodes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target))


@pytest.mark.parametrize("case", ["layer_norm+residual", "rms_norm", pytest.param("layer_norm", marks=pytest.mark.slow),
                                  pytest.param("layer_norm invertible", marks=pytest.mark.slow),
                                  pytest.param("layer_norm+branch", marks=pytest.mark.slow)])
def test_compiled_norm_graph_holds_the_triton_kernels_and_matches_eager(case):
    from tachyon.kernels import launch
    from tachyon.kernels.layernorm import layer_norm, rms_norm

    torch.manual_seed(0)
    x = torch.randn(6, 24, requires_grad=True)
    w = (torch.rand(24) + 0.5).requires_grad_()
    b = torch.randn(24, requires_grad=True)
    r = torch.randn(6, 24, requires_grad=True)
    inputs = (x, w, b, r)

    def f(x, w, b, r):
        if case == "layer_norm+residual":
            y, z = layer_norm(x, w, b, r, return_residual=True, backend="triton")
            return y * 2 + z
        if case == "layer_norm":
            return layer_norm(x, w, b, backend="triton") * r
        if case == "rms_norm":
            return rms_norm(x, w, backend="triton") * r
        if case == "layer_norm+branch":  # z = x itself, its gradient added by the norm's backward kernel (pre-LN)
            y, z = layer_norm(x, w, b, return_residual=True, backend="triton")
            return y * r + z * z
        return layer_norm(x, w, b, invertible=True, backend="triton") * r

    backend, graphs = _aot_capture()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    out = compiled(*inputs)
    out.square().sum().backward()
    got = [out.detach()] + [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    ref = f(*inputs)
    ref.square().sum().backward()
    want = [ref.detach()] + [t.grad for t in inputs]
    names = ["out", "dx", "dweight", "dbias", "dresidual"]
    for name, g, e in zip(names, got, want):
        if e is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    forward, backward = graphs
    # the forward kernel in the forward graph; the backward kernel in the backward graph (the
    # partial sums of dweight / dbias as torch reductions there)
    assert _triton_nodes(forward) == 1 and _triton_nodes(backward) == 1, (forward.code, backward.code)
    assert "norm_fwd" not in forward.code and "norm_bwd" not in backward.code  # no opaque custom op left
    assert launch._wrapping == 0 and launch._enabled


def test_eager_norm_calls_do_not_trace():
    """Eager calls keep the direct path: the implementation runs without the dispatcher (no
    wrap_triton), through the custom op only where torch needs it."""
    from tachyon.kernels.layernorm import layer_norm
    from tachyon.kernels.layernorm import op as norm_op

    calls = []
    real = norm_op._norm_fwd.custom_op
    norm_op._norm_fwd.custom_op = lambda *a: calls.append(1) or real(*a)
    try:
        x = torch.randn(3, 8, requires_grad=True)
        y = layer_norm(x, torch.ones(8), torch.zeros(8), backend="triton")
        y.sum().backward()
    finally:
        norm_op._norm_fwd.custom_op = real
    assert calls == []
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)), rtol=1e-5, atol=1e-5)
