"""Weight-only INT8 linear: the Triton kernel (interpreted on CPU, native on GPU) and the torch path
against the fp64 reference on the dequantized weight; per-channel, group-wise and DeepSpeed
q_groups scales; split-K; the quantizer's error bound and round trip; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tachyon.kernels.int8_linear import (
    dequantize, fake_quantize, int8_linear, int8_linear_reference, norm_int8_linear, quantize_symmetric,
    scale_group_size,
)
from tests.utils import assert_close, assert_close_to_reference

GPU = [pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.float16, torch.bfloat16)]
CPU = [("cpu", torch.float32), ("cpu", torch.float16)]
# (rows M, out N, in K, group_size, split_k): decode rows (1-16), a prefill tile, odd sizes
SHAPES = [(1, 37, 64, None, None), (3, 50, 96, 32, 2), (5, 17, 200, None, 3), (20, 33, 128, 64, None)]


def _case(m, n, k, group_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    q, scales = quantize_symmetric(w, 8, group_size=group_size)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    return x, q.to(device), scales.to(device), bias, w


@pytest.mark.parametrize("device,dtype", CPU + GPU)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_fp64_reference(device, dtype, backend, shape):
    m, n, k, group_size, split_k = shape
    x, q, scales, bias, _ = _case(m, n, k, group_size, dtype, device)
    out = int8_linear(x, q, scales, bias, split_k=split_k, backend=backend)
    oracle = int8_linear_reference(x.double(), q, scales, bias.double())
    assert out.dtype == dtype and out.shape == (m, n)
    if dtype == torch.float32:
        assert_close(out, oracle.float(), name="out")
    else:  # plain PyTorch in the same dtype: F.linear with the dequantized weight in that dtype
        lowp = F.linear(x, dequantize(q, scales).to(dtype), bias)
        assert_close_to_reference(out, lowp, oracle, name="out")


ACTS = [("gelu_tanh", None, None), ("gelu", 32, 2), ("silu", None, 3), ("swiglu", None, None), ("swiglu", 32, 2),
        ("geglu", None, 2), ("relu", 16, None)]


@pytest.mark.parametrize("device,dtype", CPU + GPU)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("activation,group_size,split_k", ACTS, ids=str)
def test_activation_epilogue_matches_bias_act(device, dtype, backend, activation, group_size, split_k):
    """act(x W~^T + b) in the GEMM's epilogue (and in the split-K reduce kernel) = the fp64 GEMM
    followed by bias_act's reference; gated activations read [gate | value] row halves."""
    from tachyon.kernels.activation.reference import bias_act_forward, is_gated

    m, n, k = 5, 2 * 19, 96
    x, q, scales, bias, _ = _case(m, n, k, group_size, dtype, device, seed=3)
    out = int8_linear(x, q, scales, bias, activation=activation, split_k=split_k, backend=backend)
    width = n // 2 if is_gated(activation) else n
    assert out.dtype == dtype and out.shape == (m, width)
    oracle = bias_act_forward(int8_linear_reference(x.double(), q, scales), bias.double(), activation)
    assert_close(oracle, int8_linear_reference(x.double(), q, scales, bias.double(), activation=activation),
                 name="reference")
    # plain PyTorch in the same dtype: the unfused GEMM, then the bias and activation
    lowp = bias_act_forward(F.linear(x, dequantize(q, scales).to(dtype)), bias, activation)
    assert_close_to_reference(out, lowp, oracle, name="out")


def test_activation_fused_equals_unfused_chain_in_fp32():
    """The decode MLP's fc1 in one launch computes what int8_linear then bias_act computed."""
    from tachyon.kernels.activation import bias_act

    x, q, scales, bias, _ = _case(3, 40, 64, None, torch.float32, "cpu", seed=4)
    for activation in ("gelu_tanh", "swiglu"):
        fused = int8_linear(x, q, scales, bias, activation=activation, backend="triton")
        chain = bias_act(int8_linear(x, q, scales, backend="triton"), bias, activation, backend="triton")
        assert_close(fused, chain, name=activation)


NORM_CASES = [(False, True, None, None, None), (True, True, "gelu_tanh", 32, 2), (False, False, "swiglu", None, 3),
              (True, False, None, None, 2)]


@pytest.mark.parametrize("device,dtype", CPU + [("cpu", torch.bfloat16)] + GPU)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rms,with_residual,activation,group_size,split_k", NORM_CASES, ids=str)
def test_norm_prologue_matches_the_norm_then_the_gemm(device, dtype, backend, rms, with_residual, activation,
                                                      group_size, split_k):
    """norm_int8_linear = layer_norm / rms_norm (with the residual add) then int8_linear: the
    norm's output is rounded to x's dtype as the norm kernel returns it, z = x + residual."""
    from tachyon.kernels.layernorm import layer_norm, rms_norm

    m, n, k = 5, 38, 96
    x, q, scales, bias, _ = _case(m, n, k, group_size, dtype, device, seed=5)
    g = torch.Generator().manual_seed(6)
    residual = torch.randn(m, k, generator=g).to(device, dtype) if with_residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    nb = None if rms else (0.1 * torch.randn(k, generator=g)).to(device, dtype)
    y, z = norm_int8_linear(x, nw, nb, q, scales, bias, residual=residual, rms=rms, eps=1e-5, activation=activation,
                            split_k=split_k, backend=backend)
    if rms:
        h, z_ref = rms_norm(x, nw, residual=residual, eps=1e-5, return_residual=True, backend="torch")
    else:
        h, z_ref = layer_norm(x, nw, nb, residual=residual, eps=1e-5, return_residual=True, backend="torch")
    expected = int8_linear(h, q, scales, bias, activation=activation, backend="torch")
    if with_residual:
        assert torch.equal(z, z_ref), "z must be x + residual rounded to x's dtype, as the norm returns it"
    else:
        assert z is x
    # the 2x-of-PyTorch rule against the same chain in fp64 (the unfused chain in x's dtype is PyTorch's)
    from tachyon.kernels.layernorm.reference import norm_forward

    z64 = z_ref.double()  # the sum rounded to x's dtype is the norm's input on both paths
    h64 = norm_forward(z64, nw.double(), None if rms else nb.double(), None, 1e-5, rms)[0]
    oracle = int8_linear_reference(h64, q, scales, bias.double(), activation=activation)
    assert_close_to_reference(y, expected, oracle, name="y")


def test_norm_prologue_refuses_bad_norm_arguments():
    x, q, scales, bias, _ = _case(2, 8, 32, None, torch.float32, "cpu")
    w = torch.ones(32)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        norm_int8_linear(x, torch.ones(31), None, q, scales)
    with pytest.raises(ValueError, match="RMSNorm"):
        norm_int8_linear(x, w, torch.zeros(32), q, scales, rms=True)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        norm_int8_linear(x, w, None, q, scales, residual=x[:1])
    with pytest.raises(ValueError, match="eps"):
        norm_int8_linear(x, w, None, q, scales, eps=-1.0)


def test_leading_dims_and_no_bias():
    x, q, scales, _, _ = _case(6, 24, 32, 16, torch.float32, "cpu")
    x3 = x.view(2, 3, 32)
    for backend in ("triton", "torch"):
        out = int8_linear(x3, q, scales, backend=backend)
        assert out.shape == (2, 3, 24)
        assert_close(out, int8_linear_reference(x3.double(), q, scales).float(), name=backend)


@pytest.mark.parametrize("group_size", [None, 16, 64])
def test_quantization_error_is_at_most_half_a_step(group_size):
    w = torch.randn(33, 128, generator=torch.Generator().manual_seed(1)) * 3
    q, scales = quantize_symmetric(w, 8, group_size=group_size)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    step = scales.repeat_interleave(128 // scales.shape[1], dim=1)
    err = (dequantize(q, scales) - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all()), f"max error / step = {float((err / step).max()):.4f} > 0.5"


def test_output_error_bound_against_the_float_weight():
    """|x W~^T - x W^T| <= sum_k |x_k| * scale / 2 for every output (the bound docs/inference.md states)."""
    x, q, scales, _, w = _case(4, 40, 96, 32, torch.float32, "cpu")
    out = int8_linear(x, q, scales, backend="torch").double()
    exact = x.double() @ w.double().t()
    step = scales.double().repeat_interleave(32, dim=1)
    bound = x.double().abs() @ (step / 2).t()
    assert bool(((out - exact).abs() <= bound + 1e-5).all())


def test_requantizing_a_quantized_weight_is_exact():
    """What MoQ relies on: weights already on the grid come back unchanged."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for bits in (8, 4):
        snapped = fake_quantize(w, bits, group_size=32)
        q, scales = quantize_symmetric(snapped, bits, group_size=32)
        assert_close(dequantize(q, scales), snapped, name=f"{bits}-bit round trip")
        assert int(q.abs().max()) <= (1 << (bits - 1)) - 1


def test_deepspeed_q_groups_layouts():
    assert scale_group_size(8, 6, q_groups=4) == (2, 6)  # chunks of two whole rows
    assert scale_group_size(4, 16, q_groups=8) == (1, 8)  # two chunks per row
    w = torch.randn(8, 6)
    q, scales = quantize_symmetric(w, 8, q_groups=4)
    assert scales.shape == (8, 1) and torch.equal(scales[0::2], scales[1::2])
    assert_close(scales[0:2, 0], w[0:2].abs().max().expand(2) / 127, name="row-pair scale")
    with pytest.raises(ValueError, match="neither whole rows"):
        scale_group_size(4, 6, q_groups=3)


@pytest.mark.parametrize("call,match", [
    (lambda x, q, s: int8_linear(x, q.float(), s), "int8 tensor"),
    (lambda x, q, s: int8_linear(x[:, :5], q, s), "features"),
    (lambda x, q, s: int8_linear(x, q, s.double()), "float32"),
    (lambda x, q, s: int8_linear(x, q, s[:, :1].repeat(1, 3)), "dividing"),
    (lambda x, q, s: int8_linear(x, q, s, torch.zeros(3)), "bias"),
    (lambda x, q, s: int8_linear(x.int(), q, s), "dtype"),
    (lambda x, q, s: int8_linear(x, q, s, activation="tanh"), "activation='tanh' is not supported"),
    (lambda x, q, s: int8_linear(x, q[:7], s[:7], activation="swiglu"), "must be even"),
    (lambda x, q, s: quantize_symmetric(q.float(), 9), "num_bits"),
    (lambda x, q, s: quantize_symmetric(q.float(), 8, group_size=5), "group_size"),
])
def test_bad_input_is_refused(call, match):
    x, q, scales, _, _ = _case(2, 8, 32, None, torch.float32, "cpu")
    with pytest.raises(ValueError, match=match):
        call(x, q, scales)


def test_triton_refuses_groups_it_cannot_tile():
    x, q, scales, _, _ = _case(2, 8, 24, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="multiple of 16"):
        int8_linear(x, q, scales, backend="triton")


_AOT_SCRIPT = """
from tests.utils.aot import compile_sm90
from tachyon.kernels.int8_linear import triton as tri

def gemm(dtype, grouped, split, act, gated, norm, residual, block_m, block_n, block_k):
    types = {"X": dtype, "W": "*i8", "S": "*fp32", "B": dtype, "OUT": dtype, "PART": "*fp32", "R": dtype, "NW": dtype,
             "NB": dtype, "Z": dtype, "eps": "fp32"}
    consts = dict(GROUPED=grouped, HAS_BIAS=True, SPLIT=split, ACT=act, GATED=gated, NORM=norm, HAS_RES=residual,
                  HAS_NB=norm == 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  DOT_PRECISION="ieee" if dtype == "*fp32" else None)
    compile_sm90(tri._int8_linear_kernel, types, consts, num_warps=4, aligned_ints=("stride_xm", "stride_wn", "K"))

gemm("*fp16", False, True, -1, False, 0, False, 16, 64, 128)   # decode, split-K partials
gemm("*bf16", True, False, 1, False, 1, True, 16, 64, 128)     # LayerNorm + residual prologue, GELU epilogue
gemm("*fp16", False, False, 3, True, 2, True, 16, 64, 128)     # RMSNorm prologue, SwiGLU epilogue
gemm("*bf16", False, False, -1, False, 0, False, 64, 64, 64)   # prefill tile
gemm("*fp32", True, True, -1, True, 0, False, 16, 64, 128)     # fp32, grouped scales, gated split
types = {"PART": "*fp32", "B": "*fp16", "OUT": "*fp16"}
compile_sm90(tri._split_reduce_kernel, types, dict(HAS_BIAS=True, ACT=3, GATED=True, BLOCK_M=16, BLOCK_N=64),
             num_warps=4)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never runs Triton's compiler: build the INT8 GEMM (TTIR -> PTX -> cubin with
    the bundled ptxas) for an H100 with each prologue and epilogue (norm + residual, activation,
    gated, split-K partials) and the split-K reduce kernel."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=6)
