"""torch.compile over tachyon's Triton ops (Triton's interpreter): the kernels themselves in the graph.

Every op below is registered with ``torch.library.triton_op`` (kernels/registry.py). A small
function using it is compiled with an AOT backend that keeps the forward and backward graphs, and
run for 3 steps at one shape. Checked: dynamo handed the backend one graph (no graph break, no
recompile), with no graph-break counter; the AOT graphs hold the op's Triton kernels
(``triton_kernel_wrapper_functional`` nodes, named by kernel) and no opaque ``tachyon::`` op; the
outputs and gradients of the last step equal eager ones. Before the conversion every such op was
one opaque custom op, with no kernel node in the graphs. Changed shapes recompile where expected:
once for the first new shape (torch.compile's automatic dynamic shapes), then never again for the
rows of a 2-D op; attention once more per power-of-two bucket of the sequence length (its kernels'
autotuning key). The GPU path on a stubbed sm_90 launch (where torch lowers the kernels to find
what they write) is tests/test_compile_gpu_path.py's.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tachyon.kernels.activation import bias_act
from tachyon.kernels.attention import attention, attention_qkvpacked
from tachyon.kernels.dropout import bias_dropout_add, bias_dropout_add_layer_norm
from tachyon.kernels.fp8_block_cast import block_cast_to_fp8, scale_from_amax
from tachyon.kernels.fp8_cast import cast_to_fp8
from tachyon.kernels.linear import mlp
from tachyon.kernels.rope import apply_rotary

T = "triton"
H, FFN, HEADS, D, B, S = 32, 64, 2, 16, 2, 8


def _kernel_names(gm) -> list[str]:
    """The Triton kernels a graph launches, in order (by their Python function's name)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            while not inspect.isfunction(kernel):  # Autotuner -> JITFunction -> the Python function
                kernel = kernel.fn
            names.append(kernel.__name__)
    return names


def _aot_capture():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs, aot_graphs = [], []

    def keep(gm, example_inputs):
        aot_graphs.append(gm)
        return make_boxed_func(gm.forward)

    inner = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def counting(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return counting, graphs, aot_graphs


def _leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).requires_grad_()


def _case(name):
    """(function, its tensor inputs, forward kernels, backward kernels or None without autograd)."""
    torch.manual_seed(0)
    seed = torch.tensor(11)
    x, r = _leaf(B * S, H), _leaf(B * S, H)
    b, w = _leaf(H), (torch.rand(H) + 0.5).requires_grad_()
    q, k, v = _leaf(B, HEADS, S, D), _leaf(B, HEADS, S, D), _leaf(B, HEADS, S, D)
    pad = torch.zeros(B, S)
    pad[0, S // 2:] = float("-inf")
    qkv, qkv_bias = _leaf(B, S, 3 * HEADS * D), _leaf(3 * HEADS * D)
    angles = torch.randn(S, D)
    cos, sin = angles.cos(), angles.sin()
    w1, b1, w2, b2 = _leaf(FFN, H, scale=0.2), _leaf(FFN), _leaf(H, FFN, scale=0.2), _leaf(H)
    w2g = _leaf(H, FFN // 2, scale=0.2)
    fwd_bwd_dq_dkdv = (["_fwd_kernel"], ["_bwd_dq_kernel", "_bwd_dkdv_kernel"])
    cases = {
        # bias + activation, then the fused bias + dropout + residual + LayerNorm (a post-LN block's end)
        "bias_act+bias_dropout_add_layer_norm": (
            lambda x, b, r, w: bias_dropout_add_layer_norm(bias_act(x, b, "gelu", backend=T), b, r, w, b, 1e-5, 0.1,
                                                           seed, backend=T)[0],
            (x, b, r, w), ["_bias_act_fwd_kernel", "_bda_norm_fwd_kernel"],
            ["_bda_norm_bwd_kernel", "_bias_act_bwd_kernel"]),
        "bias_act swiglu without bias": (
            lambda x: bias_act(x, None, "swiglu", backend=T), (x,), ["_bias_act_fwd_kernel"], ["_bias_act_bwd_kernel"]),
        "bias_dropout_add": (
            lambda x, b, r: bias_dropout_add(x, b, r, 0.1, seed, backend=T), (x, b, r), ["_bda_fwd_kernel"],
            ["_bda_bwd_kernel"]),
        "mlp": (
            lambda x, w1, b1, w2, b2: mlp(x, w1, b1, "gelu", w2, b2, backend=T), (x, w1, b1, w2, b2),
            ["_gemm_act_kernel"], ["_gemm_act_kernel"]),
        "mlp swiglu without bias": (
            lambda x, w1, w2g: mlp(x, w1, None, "swiglu", w2g, None, backend=T), (x, w1, w2g),
            ["_gemm_act_kernel"], ["_gemm_act_kernel"]),
        "attention causal": (lambda q, k, v: attention(q, k, v, causal=True, backend=T), (q, k, v), *fwd_bwd_dq_dkdv),
        # a tensor seed and a padding bias: inputs of the compiled graph that the backward kernels read
        "attention dropout+padding": (
            lambda q, k, v: attention(q, k, v, key_padding_bias=pad, dropout_p=0.1, seed=seed, backend=T), (q, k, v),
            *fwd_bwd_dq_dkdv),
        "attention deterministic=False": (
            lambda q, k, v: attention(q, k, v, causal=True, deterministic=False, backend=T), (q, k, v), ["_fwd_kernel"],
            ["_bwd_delta_kernel", "_bwd_dkdv_kernel"]),
        "attention one_kernel_backward": (
            lambda q, k, v: attention(q, k, v, causal=True, one_kernel_backward=True, backend=T), (q, k, v),
            ["_fwd_kernel"], ["_bwd_one_kernel"]),
        # the QKV bias's gradient: partial sums whose row count depends on the autotuned BLOCK_N
        "attention_qkvpacked qkv_bias": (
            lambda qkv, qkv_bias: attention_qkvpacked(qkv, HEADS, qkv_bias=qkv_bias, causal=True, backend=T),
            (qkv, qkv_bias), *fwd_bwd_dq_dkdv),
        "attention_qkvpacked qkv_bias one_kernel_backward": (
            lambda qkv, qkv_bias: attention_qkvpacked(qkv, HEADS, qkv_bias=qkv_bias, one_kernel_backward=True,
                                                      backend=T),
            (qkv, qkv_bias), ["_fwd_kernel"], ["_bwd_one_kernel"]),
        "attention_qkvpacked RoPE": (
            lambda qkv: attention_qkvpacked(qkv, HEADS, rotary_cos=cos, rotary_sin=sin, causal=True, backend=T), (qkv,),
            ["_rope_kernel", "_fwd_kernel"], ["_bwd_dq_kernel", "_bwd_dkdv_kernel", "_rope_kernel"]),
        "apply_rotary": (
            lambda q, k: torch.cat(apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend=T), 2),
            (q, k), ["_rope_kernel"], ["_rope_kernel"]),
    }
    return cases[name]


DEFAULT = ["bias_act+bias_dropout_add_layer_norm", "attention_qkvpacked qkv_bias"]
SLOW = ["bias_act swiglu without bias", "bias_dropout_add", "mlp", "mlp swiglu without bias", "attention causal",
        "attention dropout+padding", "attention deterministic=False", "attention one_kernel_backward",
        "attention_qkvpacked qkv_bias one_kernel_backward", "attention_qkvpacked RoPE", "apply_rotary"]


def _grads(inputs):
    grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    return grads


@pytest.mark.parametrize("name", DEFAULT + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_compiled_op_graph_holds_its_triton_kernels_no_break_no_recompile_and_matches_eager(name):
    from torch._dynamo.utils import counters

    fn, inputs, fwd_kernels, bwd_kernels = _case(name)
    torch._dynamo.reset()
    counters.clear()
    backend, graphs, aot_graphs = _aot_capture()
    compiled = torch.compile(fn, backend=backend)
    for _ in range(3):
        out = compiled(*inputs)
        out.float().square().sum().backward()
        got = [out.detach()] + _grads(inputs)
    assert len(graphs) == 1, f"{name}: {len(graphs)} graphs for 3 steps of one shape (a graph break or a recompile)"
    assert not counters["graph_break"], dict(counters["graph_break"])
    forward, backward = aot_graphs
    assert _kernel_names(forward) == fwd_kernels, forward.code
    assert _kernel_names(backward) == bwd_kernels, backward.code
    assert "tachyon" not in forward.code + backward.code  # no opaque tachyon op left in either graph

    ref = fn(*inputs)
    ref.float().square().sum().backward()
    want = [ref.detach()] + _grads(inputs)
    for i, (g, e) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"{name}, result {i}: {m}")


@pytest.mark.parametrize("transpose", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_fp8_casts_hold_their_kernels_update_amax_and_match_eager(transpose):
    """No autograd here: one inference graph. cast_to_fp8 mutates amax (its op's mutates_args)."""
    from torch._dynamo.utils import counters

    def fn(x, scale, amax):
        x8 = cast_to_fp8(x, scale, torch.float8_e4m3fn, amax, transpose=transpose, backend=T)
        blocks = block_cast_to_fp8(x, torch.float8_e4m3fn, 32, rows=True, cols=True, backend=T)
        s, s_inv = scale_from_amax(amax, 448.0, backend=T)
        return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t
                for t in (*(x8 if transpose else (x8,)), *blocks, s, s_inv)]

    torch.manual_seed(0)
    scale = torch.tensor(4.0)
    torch._dynamo.reset()
    counters.clear()
    backend, graphs, aot_graphs = _aot_capture()
    compiled = torch.compile(fn, backend=backend)
    amax_c, amax_e = torch.zeros(()), torch.zeros(())
    for step in range(3):
        x = torch.randn(40, 48) * (step + 1)
        got, want = compiled(x, scale, amax_c), fn(x, scale, amax_e)
        for i, (g, e) in enumerate(zip(got, want)):
            assert torch.equal(g, e), (step, i)
        assert torch.equal(amax_c, amax_e) and amax_c > 0, (amax_c, amax_e)
    assert len(graphs) == 1 and not counters["graph_break"], (len(graphs), dict(counters["graph_break"]))
    (graph,) = aot_graphs
    cast = "_cast_transpose_kernel" if transpose else "_cast_flat_kernel"
    assert _kernel_names(graph) == [cast, "_block_cast_kernel", "_scale_from_amax_kernel"], graph.code
    assert "tachyon" not in graph.code


def _steps(fn, shapes, make):
    """Compile ``fn``; run it forward+backward on inputs of each shape; the number of dynamo graphs
    after each call, and whether every result equalled eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend, graphs, _ = _aot_capture()
    compiled = torch.compile(fn, backend=backend)
    counts, same = [], True
    for shape in shapes:
        inputs = make(shape)
        out = compiled(*inputs)
        out.float().square().sum().backward()
        got = [out.detach()] + _grads(inputs)
        ref = fn(*inputs)
        ref.float().square().sum().backward()
        same = same and all(torch.allclose(g, e, rtol=1e-4, atol=1e-4) for g, e in zip(got, [ref.detach()] + _grads(inputs)))
        counts.append(len(graphs))
    assert not counters["graph_break"], dict(counters["graph_break"])
    return counts, same


def test_changed_rows_recompile_once_then_never():
    """A new row count: one recompile, with the rows symbolic; later row counts reuse that graph.
    Guards the traced launchers against concrete-only host code: a symbolic row count handed to a
    cached helper (sum_partials' launch geometry, an lru_cache) fails the compile."""
    torch.manual_seed(0)
    b = torch.randn(H, requires_grad=True)

    def fn(x):
        return bias_act(x, b, "gelu", backend=T)

    counts, same = _steps(fn, [8, 16, 24, 8], lambda m: (_leaf(m, H),))
    assert counts == [1, 2, 2, 2] and same, counts


@pytest.mark.slow
def test_changed_sequence_length_recompiles_per_power_of_two_bucket():
    """Attention's kernels take the sequence length's power-of-two bucket (their autotuning key):
    a traced call guards on the bucket, not on the length (computed with ints.next_power_of_2,
    whose bit_length specializes on the exact length, every new length recompiled)."""
    seed = torch.tensor(3)

    def fn(q, k, v):
        return attention(q, k, v, causal=True, dropout_p=0.1, seed=seed, backend=T)

    # 8: the first, static graph; 16: dynamic, bucket 16 (9..16); 24: bucket 32; 20, 32: bucket 32; 12: bucket 16
    counts, same = _steps(fn, [8, 8, 16, 24, 20, 32, 12], lambda s: tuple(_leaf(1, HEADS, s, D) for _ in range(3)))
    assert counts == [1, 1, 2, 3, 3, 3, 3] and same, counts
