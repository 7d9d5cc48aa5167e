"""kernels/linear's ``mlp``: the GEMMs with the activation in their epilogues (Triton, interpreted
on CPU, native on GPU) and the torch path, forward and every gradient, against the autograd chain
F.linear -> bias + activation -> F.linear; the residual branch; checkpoint_activation; the launches
and bytes the fusion saves; torch.compile; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tachyon.kernels.activation import ACTIVATIONS, reference
from tachyon.kernels.linear import mlp
from tachyon.profiling import TrafficCounter
from tests.utils import assert_close, assert_close_to_reference

# bf16 on the GPU only: the interpreter's fp32 -> bf16 conversion truncates (twice the rounding error)
CPU_CASES = [("cpu", torch.float32), ("cpu", torch.float16)]
GPU_CASES = [pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.float16, torch.bfloat16)]
# (leading shape, in K, ffn F, out O): odd sizes, a tail in every dimension, more than one row block
SHAPES = [((5, 23), 37, 45, 29), ((70,), 64, 96, 64)]


def _chain(x, w1, b1, activation, w2, b2, residual_scale):
    """The autograd oracle: F.linear, bias + activation, F.linear (+ a residual use of x)."""
    out = F.linear(reference.bias_act(F.linear(x, w1), b1, activation), w2, b2)
    return out, (x * residual_scale).sum()


def _leaves(lead, k, f, o, activation, dtype, device, biases, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * f if activation in reference.GATED else f

    def make(*shape, scale):
        return (scale * torch.randn(*shape, generator=g)).to(device, dtype).requires_grad_()

    return [make(*lead, k, scale=1.0), make(rows, k, scale=k ** -0.5), make(rows, scale=0.5) if biases else None,
            make(o, f, scale=f ** -0.5), make(o, scale=0.5) if biases else None]


def _run(fn, leaves, grad, residual_scale):
    out, res = fn(*leaves, residual_scale)
    used = [t for t in leaves if t is not None]
    return [out, *torch.autograd.grad((out.double() * grad).sum() + res, used)]


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation,biases", [(a, True) for a in ACTIVATIONS] + [("gelu", False), ("swiglu", False)])
def test_mlp_matches_the_unfused_chain_forward_and_backward(device, dtype, backend, shape, activation, biases):
    lead, k, f, o = shape
    leaves = _leaves(lead, k, f, o, activation, dtype, device, biases)
    grad = torch.randn(*lead, o, device=device)
    residual_scale = torch.randn(k, device=device, dtype=dtype)

    def fused(x, w1, b1, w2, b2, scale):
        out, x_res = mlp(x, w1, b1, activation, w2, b2, return_residual=True, backend=backend)
        assert x_res.data_ptr() == x.data_ptr() and x_res.shape == x.shape, "the residual branch is x itself"
        return out, (x_res * scale).sum()

    def chain(x, w1, b1, w2, b2, scale):
        return _chain(x, w1, b1, activation, w2, b2, scale)

    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    got = _run(fused, leaves, grad, residual_scale)
    lowp = _run(chain, leaves, grad, residual_scale)
    oracle = _run(chain, leaves64, grad, residual_scale.double())
    names = [n for n, t in zip(["out", "dx", "dw1", "db1", "dw2", "db2"], [leaves[0], *leaves]) if t is not None]
    for name, g_, lo, o_ in zip(names, got, lowp, oracle):
        assert g_.dtype == lo.dtype and g_.shape == lo.shape, f"{name}: {g_.dtype} {tuple(g_.shape)}"
        assert_close_to_reference(g_, lo, o_, name=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_checkpoint_activation_gives_the_same_gradients_and_keeps_no_activation(backend, activation):
    lead, k, f, o = SHAPES[0]
    leaves = _leaves(lead, k, f, o, activation, torch.float32, "cpu", True, seed=1)
    grads, saved = {}, {}
    for ckpt in (False, True):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            out = mlp(*leaves[:3], activation, *leaves[3:], checkpoint_activation=ckpt, backend=backend)
        grads[ckpt] = torch.autograd.grad(out.sum(), [t for t in leaves if t is not None])
        saved[ckpt] = sum(sizes)
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b), "checkpoint_activation must not change a gradient"
    tokens = 5 * 23
    assert saved[False] - saved[True] == tokens * f, "checkpoint_activation drops exactly the activation [tokens, F]"


def test_triton_fusion_saves_two_launches_and_three_ffn_passes():
    """Against F.linear + bias_act + F.linear: the fused op does not write fc1's GEMM output and
    read it back (forward: the epilogue writes pre and y, the chain wrote x W1^T, read it, wrote
    y), nor write dY and read it back (backward): 3 * tokens * F elements, and two launches; the
    bias is read once, not twice, and the bias gradient's partial rows are one per row block."""
    from tachyon.kernels.activation import bias_act

    lead, k, f, o = (64,), 32, 96, 32
    leaves = _leaves(lead, k, f, o, "gelu", torch.float32, "cpu", True, seed=2)
    grad = torch.randn(64, o)
    counts = {}
    for name in ("chain", "fused"):
        with TrafficCounter() as counter:
            if name == "chain":
                out = F.linear(bias_act(F.linear(leaves[0], leaves[1]), leaves[2], "gelu", backend="triton"),
                               leaves[3], leaves[4])
            else:
                out = mlp(*leaves[:3], "gelu", *leaves[3:], backend="triton")
            torch.autograd.grad(out, leaves, grad)
        counts[name] = counter.total
        # the partial rows of the bias gradient: written by the kernel, read by _sum_partials_kernel
        counts[name + " partials"] = 2 * sum(e.traffic.read for e in counter.events
                                             if e.op == "triton _sum_partials_kernel")
    assert counts["chain"].launches - counts["fused"].launches == 2, (counts["chain"], counts["fused"])
    saved = 3 * 64 * f * 4 + f * 4 + counts["chain partials"] - counts["fused partials"]
    assert counts["chain"].bytes - counts["fused"].bytes == saved, (counts["chain"], counts["fused"])


def test_compiles_without_graph_breaks():
    lead, k, f, o = SHAPES[0]
    leaves = _leaves(lead, k, f, o, "gelu_tanh", torch.float32, "cpu", True, seed=3)

    def fn(x, w1, b1, w2, b2):
        return mlp(x, w1, b1, "gelu_tanh", w2, b2, backend="torch")

    expected = fn(*leaves)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert_close(compiled(*leaves), expected, name="compiled")


@pytest.mark.parametrize("call,match", [
    (lambda x, w1, b1, w2, b2: mlp(x, w1, b1, "tanh", w2, b2), "activation='tanh'"),
    (lambda x, w1, b1, w2, b2: mlp(x, w1[:, :5], b1, "gelu", w2, b2), "weight1 has shape"),
    (lambda x, w1, b1, w2, b2: mlp(x, w1, b1, "gelu", w2[:, :5], b2), "weight2 has shape"),
    (lambda x, w1, b1, w2, b2: mlp(x, w1, b1[:3], "gelu", w2, b2), "bias1 has shape"),
    (lambda x, w1, b1, w2, b2: mlp(x, w1[:5], None, "swiglu", w2, b2), "must be even"),
    (lambda x, w1, b1, w2, b2: mlp(x, w1.double(), b1, "gelu", w2, b2), "weight1 has dtype"),
    (lambda x, w1, b1, w2, b2: mlp(x, w1, b1, "gelu", w2, b2, checkpoint_activation=1), "checkpoint_activation"),
])
def test_bad_input_is_refused(call, match):
    x, w1, b1, w2, b2 = _leaves((4,), 8, 6, 5, "gelu", torch.float32, "cpu", True)
    with pytest.raises(ValueError, match=match):
        call(x, w1, b1, w2, b2)


_AOT_SCRIPT = """
from tests.utils.aot import compile_sm90
from tachyon.kernels.linear import triton as tri

def gemm(dtype, mode, act, gated, bias, block_n, block_k, warps, stages):
    types = {"A": dtype, "B": dtype, "BIAS": dtype, "OUT": dtype, "PRE": dtype, "PART": "*fp32"}
    consts = dict(MODE=mode, ACT=act, GATED=gated, B_GATED=gated and mode == 0, HAS_BIAS=bias, UPCAST=False,
                  DOT_PRECISION="ieee" if dtype == "*fp32" else None, BLOCK_M=128, BLOCK_N=block_n,
                  BLOCK_K=block_k, GROUP=tri.GROUP_M)
    compile_sm90(tri._gemm_act_kernel, types, consts, num_warps=warps, num_stages=stages,
                 aligned_ints=("stride_am", "stride_bn", "stride_om", "stride_pm", "K", "N"))

gemm("*bf16", 0, 0, False, True, 256, 64, 8, 3)   # BERT: bias + erf GELU, the largest tile
gemm("*fp16", 0, 3, True, False, 128, 64, 8, 3)   # Llama: SwiGLU, two accumulators
gemm("*bf16", 1, 0, False, True, 128, 64, 8, 3)   # backward: GELU' and the bias partial sums
gemm("*bf16", 1, 3, True, False, 64, 64, 4, 4)    # backward: SwiGLU's two halves
gemm("*fp32", 0, 1, False, True, 128, 32, 4, 4)   # fp32: IEEE dots
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never runs Triton's compiler: build the epilogue GEMM (TTIR -> PTX -> cubin
    with the bundled ptxas) for an H100 in both modes, plain and gated, bf16/fp16/fp32, at the
    autotuner's tile shapes."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=5)
