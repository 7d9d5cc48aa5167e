"""Current and block scaling against an independent reference (tests/fp8/reference.py): per-tensor
and per-block amax, the scale rule (epsilon, zero / inf / NaN amax, fp32 overflow, power of 2),
E4M3 / E5M2 rounding with saturation, ties, zeros and subnormals, the emulated GEMMs, and the
forward and backward of tachyon.nn.Linear under every recipe, bit for bit where the operands are
compared and to fp32 accumulation where a GEMM sums them."""

from __future__ import annotations

import math

import pytest
import torch

import tachyon
import tachyon.nn as tnn
from tachyon.fp8 import (
    Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, QParams, block_gemm, compute_scale,
    current_scale, dequantize, quantize_blocks,
)
from tests.fp8 import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4M3: "e4m3", E5M2: "e5m2"}


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().double().tolist()


def _assert_equal_values(got: torch.Tensor, want: list[list[float]], name: str) -> None:
    """Exact equality, NaN where the reference has NaN; the report names the first mismatch."""
    want_t = torch.tensor(want, dtype=torch.float64)
    got = got.double()
    same = (got == want_t) | (got.isnan() & want_t.isnan())
    if not bool(same.all()):
        bad = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int((~same).sum())} of {same.numel()} values differ; first at {bad}: "
                             f"got {got[tuple(bad)].item()!r}, reference {want_t[tuple(bad)].item()!r}")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("fp8_max,fmt", [(448.0, "e4m3"), (57344.0, "e5m2")])
def test_scale_rule_matches_the_reference_on_edge_amaxes(pow2, eps, fp8_max, fmt):
    amaxes = [0.0, math.inf, math.nan, 1e-45, 1e-40, 2.0 ** -126, 1e-4, 0.1, 1.0, 3.0, 447.0, 448.0, 1e4, 3e38,
              448.0 / 1024, 1.75 * 2.0 ** -3]
    got = compute_scale(torch.tensor(amaxes, dtype=torch.float32), fp8_max, QParams(pow2, eps))
    for amax, value in zip(amaxes, got.tolist()):
        want = ref.scale_of(ref.f32(amax), fmt, pow2=pow2, eps=eps)
        assert value == want, f"amax {amax!r}: scale {value!r}, reference {want!r}"


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_cast_is_the_reference_bit_for_bit(fp8_dtype, pow2):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 48, generator=gen) * torch.logspace(-6, 3, 48)  # nine decades in one tensor
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-41, -3e-42])  # zeros and fp32 subnormals
    fmt = FMT[fp8_dtype]
    scale, scale_inv = current_scale(x, ref.FP8_MAX[fmt], QParams(pow2))
    want_q, _, want_inv = ref.quantize(_rows(x), fmt, (32, 48), pow2=pow2)
    assert scale_inv.item() == want_inv[0][0]
    x8 = tachyon.fp8.cast_to_fp8(x, scale, fp8_dtype)
    _assert_equal_values(x8.float(), want_q, f"current scaling {fmt}")


def test_rounding_ties_go_to_the_even_code_and_saturation_clamps():
    """Values placed exactly between two FP8 values (scale 1: the block's amax is 448)."""
    row = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 0.0, 240.0 + 8.0, 232.0, 2.0 ** -9 * 1.5]
    x = torch.tensor([row * 13 + [0.0] * 2], dtype=torch.float32)  # 132 columns: a partial second block
    q = quantize_blocks(x, E4M3, (1, 128), QParams(power_2_scale=True))
    assert q.scale_inv[0, 0].item() == 1.0
    got = q.data.float()[0, :10].tolist()
    assert got == [448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, 0.0, 256.0, 224.0, 2.0 ** -8], got
    want_q, _, _ = ref.quantize(_rows(x), "e4m3", (1, 128), pow2=True)
    _assert_equal_values(q.data.float(), want_q, "ties")
    # saturation: a fixed scale that overflows E5M2's range clamps to +-57344 instead of inf
    big = tachyon.fp8.cast_to_fp8(torch.tensor([1e5, -7e4, 6e4]), torch.tensor(1.0), E5M2)
    assert big.float().tolist() == [57344.0, -57344.0, 57344.0]
    assert [ref.round_fp8(v, "e5m2") for v in (1e5, -7e4, 6e4)] == [57344.0, -57344.0, 57344.0]


@pytest.mark.parametrize("block,fp8_dtype,pow2", [
    ((1, 128), E4M3, True), ((128, 1), E5M2, True), ((128, 128), E4M3, True), ((1, 32), E4M3, True),
    ((32, 1), E5M2, True), ((1, 128), E5M2, False), ((128, 128), E5M2, False),
], ids=str)
def test_block_quantization_is_the_reference_bit_for_bit(block, fp8_dtype, pow2):
    """Per-block amax, scales and FP8 values on odd shapes (partial blocks), with a zero block,
    a NaN block, subnormal values and blocks of very different magnitudes; bf16 input (the scale
    overflows to bf16's largest value, as Transformer Engine's value_for_inf)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(136, 144, generator=gen) * torch.logspace(-4, 4, 144)
    x[:128, :128] *= 1e-30  # tiny blocks whose scale overflows
    x[:, 130:136] = 0.0
    x[128:, 128:] = 0.0  # a whole partial block of zeros
    x[3, 5] = float("nan")
    x[7, 100:104] = torch.tensor([1e-39, -2e-40, 5e-44, 0.0])
    x = x.to(torch.bfloat16)
    fmt = FMT[fp8_dtype]
    q = quantize_blocks(x, fp8_dtype, block, QParams(pow2))
    want_q, want_deq, want_inv = ref.quantize(_rows(x), fmt, block, pow2=pow2, value_for_inf=ref.BF16_MAX)
    _assert_equal_values(q.scale_inv, want_inv, f"scale_inv {block}")
    _assert_equal_values(q.data.float(), want_q, f"FP8 values {block}")
    _assert_equal_values(dequantize(q), want_deq, f"dequantized {block}")


@pytest.mark.parametrize("a_block,b_block", [((1, 128), (128, 128)), ((128, 128), (1, 128)), ((1, 128), (1, 128)),
                                             ((1, 32), (1, 32))], ids=str)
def test_emulated_block_gemm_is_the_product_of_the_dequantized_operands(a_block, b_block):
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(48, 160, generator=gen) * 3, torch.randn(32, 160, generator=gen) / 7
    qa = quantize_blocks(a, E4M3, a_block, QParams(True))
    qb = quantize_blocks(b, E4M3, b_block, QParams(True))
    out = block_gemm(qa, qb, torch.float32)
    _, deq_a, _ = ref.quantize(_rows(a), "e4m3", a_block, pow2=True)
    _, deq_b, _ = ref.quantize(_rows(b), "e4m3", b_block, pow2=True)
    want, bound = ref.matmul_nt(deq_a, deq_b)
    err = (out.double() - want).abs()
    assert bool((err <= 1e-6 * bound + 1e-30).all()), f"max error {err.max().item()} (fp32 accumulation allows ~1e-7 of |a||b|)"
    with pytest.raises(ValueError, match="do not both run along K"):
        block_gemm(qa, quantize_blocks(b, E4M3, (128, 1), QParams(True)), torch.float32)


# ---------------------------------------------------------------- Linear under each recipe
def _roles(recipe) -> dict[str, tuple[tuple[int, int], str]]:
    """Independently of the library: how each GEMM operand is quantized. Keys: x_fprop, w_fprop,
    g_dgrad, w_dgrad, g_wgrad, x_wgrad -> (block shape on the tensor as it is [rows, cols], format)."""
    fwd = "e5m2" if recipe.fp8_format is Format.E5M2 else "e4m3"
    bwd = "e4m3" if recipe.fp8_format is Format.E4M3 else "e5m2"
    whole = (10 ** 9, 10 ** 9)
    if isinstance(recipe, Float8CurrentScaling):
        return {k: (whole, fwd if k[0] in "xw" else bwd) for k in
                ("x_fprop", "w_fprop", "g_dgrad", "w_dgrad", "g_wgrad", "x_wgrad")}
    size = recipe.block_size
    dims = {"x": recipe.x_block_scaling_dim, "w": recipe.w_block_scaling_dim, "g": recipe.grad_block_scaling_dim}

    def along(role: str, contraction_over_rows: bool):
        if dims[role] == 2:
            return (size, size)
        return (size, 1) if contraction_over_rows else (1, size)

    # x [M, K] and w [N, K] contract over K (their columns) in fprop; w [N, K] over N (rows) in
    # dgrad, g [M, N] over N (columns); in wgrad g and x over M (their rows)
    return {"x_fprop": (along("x", False), fwd), "w_fprop": (along("w", False), fwd),
            "g_dgrad": (along("g", False), bwd), "w_dgrad": (along("w", True), fwd),
            "g_wgrad": (along("g", True), bwd), "x_wgrad": (along("x", True), fwd)}


def _deq(t: torch.Tensor, spec, pow2: bool, value_for_inf: float) -> list[list[float]]:
    block, fmt = spec
    return ref.quantize(_rows(t), fmt, (min(block[0], t.shape[0]), min(block[1], t.shape[1])), pow2=pow2,
                        value_for_inf=value_for_inf)[1]


def _check(name: str, got: torch.Tensor, a: list[list[float]], b: list[list[float]]) -> None:
    """got = a @ b.T up to fp32 accumulation."""
    want, bound = ref.matmul_nt(a, b)
    err = (got.double() - want).abs()
    assert bool((err <= 2e-6 * bound + 1e-30).all()), f"{name}: max error {err.max().item():.3g} vs bound {bound.max().item():.3g}"


RECIPES = [
    Float8CurrentScaling(),
    Float8CurrentScaling(fp8_format=Format.E4M3, use_power_2_scales=True),
    Float8BlockScaling(),
    Float8BlockScaling(fp8_format=Format.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1),
    Float8BlockScaling(use_f32_scales=True, grad_block_scaling_dim=2, w_block_scaling_dim=1),
    MXFP8BlockScaling(),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{type(r).__name__}-{r.fp8_format.name}")
def test_linear_forward_and_backward_are_the_recipes_arithmetic(recipe, monkeypatch):
    """y = deq(x) deq(w)^T + b, dx = deq(g) deq(w), dw = deq(g)^T deq(x) with every operand
    quantized as the recipe says for that GEMM (M=32, K=N=144: partial 128-blocks)."""
    if isinstance(recipe, MXFP8BlockScaling):  # refused on CPU (tested elsewhere); its arithmetic is checked here
        monkeypatch.setattr(tachyon.fp8.context, "recipe_support", lambda recipe, device=None: (True, ""))
    gen = torch.Generator().manual_seed(4)
    layer = tnn.Linear(144, 144, params_dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(144, 144, generator=gen) * torch.logspace(-2, 1, 144) / 10)
        layer.bias.normal_(generator=gen)
    x = (torch.randn(32, 144, generator=gen) * 4).requires_grad_()
    g = torch.randn(32, 144, generator=gen) * torch.logspace(-5, -1, 144)
    with tachyon.autocast(recipe=recipe):
        y = layer(x)
    y.backward(g)
    roles = _roles(recipe)
    pow2 = recipe.fp8_quant_fwd_inp.power_2_scale
    vfi = ref.FP32_MAX  # fp32 tensors: fp32's largest value either way
    w = layer.weight.detach()
    _check("forward", y.detach() - layer.bias.detach(), _deq(x, roles["x_fprop"], pow2, vfi),
           _deq(w, roles["w_fprop"], pow2, vfi))
    _check("dgrad", x.grad, _deq(g, roles["g_dgrad"], pow2, vfi), ref.transpose(_deq(w, roles["w_dgrad"], pow2, vfi)))
    _check("wgrad", layer.weight.grad, ref.transpose(_deq(g, roles["g_wgrad"], pow2, vfi)),
           ref.transpose(_deq(x, roles["x_wgrad"], pow2, vfi)))
    assert torch.equal(layer.bias.grad, g.sum(0))
