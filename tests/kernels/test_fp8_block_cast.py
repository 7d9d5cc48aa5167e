"""The block-scaled FP8 cast: the Triton kernel (interpreted on CPU, native on GPU) bit for bit
against its PyTorch reference in every mode (rows, columns, both from one read, squares with and
without their transpose), FP8 dtype, block size (128, 32), power-of-2 or fp32 scales, epsilon, input
dtype, strided inputs, partial blocks, zero / NaN / subnormal blocks; torch.compile; bad input.
The reference itself is checked against an independent one in tests/fp8/test_recipe_arithmetic.py."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.fp8_block_cast import block_cast_to_fp8
from tests.utils.interpreter import requires_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
MODES = {"rows": dict(rows=True), "cols": dict(rows=False, cols=True), "both": dict(rows=True, cols=True),
         "square": dict(square=True), "square+t": dict(square=True, cols=True)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8 if t.element_size() == 1 else torch.int32)


def _input(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-5, 5, cols)
    x[: min(rows, 32), : min(cols, 32)] = 0.0  # a zero block at block size 32
    x[1, -1] = float("nan")
    x[-1, 0] = 1e-40  # fp32 subnormal (0 in fp16/bf16 where it underflows)
    return x.to(dtype)


def _assert_same(got, want, name):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name} output {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        bad = (_bits(g) != _bits(w)).nonzero()
        assert bad.numel() == 0, f"{name} output {i}: {bad.shape[0]} values differ, first at {bad[0].tolist()}"


CASES = [(mode, E4M3, 128, True, 0.0, torch.bfloat16) for mode in MODES] + [
    (mode, fp8_dtype, size, pow2, eps, dtype) for mode in ("both", "square+t")
    for fp8_dtype, size, pow2, eps, dtype in [(E5M2, 128, False, 1e-3, torch.float32), (E4M3, 32, True, 0.0, torch.float16),
                                             (E5M2, 32, False, 0.0, torch.bfloat16)]]


@requires_triton
@pytest.mark.parametrize("mode,fp8_dtype,size,pow2,eps,dtype", CASES,
                         ids=[f"{c[0]}-{'e4m3' if c[1] == E4M3 else 'e5m2'}-{c[2]}-{'pow2' if c[3] else 'f32'}-"
                              f"{str(c[5])[6:]}" for c in CASES])
def test_triton_kernel_is_the_reference_bit_for_bit(mode, fp8_dtype, size, pow2, eps, dtype):
    x = _input(size + 8, size + 16, dtype)  # partial blocks along both dimensions
    kwargs = dict(power_2_scale=pow2, amax_epsilon=eps, **MODES[mode])
    want = block_cast_to_fp8(x, fp8_dtype, size, backend="torch", **kwargs)
    got = block_cast_to_fp8(x, fp8_dtype, size, backend="triton", **kwargs)
    _assert_same(got, want, mode)
    asked_rows = MODES[mode].get("rows", True) or MODES[mode].get("square", False)
    assert (got[0].numel() > 0) == asked_rows and (got[2].numel() > 0) == MODES[mode].get("cols", False)


@requires_triton
def test_strided_input_and_transposed_views():
    x = _input(40, 136, torch.float32).t()  # [136, 40], column-major: 2 x 1 tiles
    for kwargs in (dict(rows=True, cols=True), dict(square=True, cols=True)):
        want = block_cast_to_fp8(x.contiguous(), E4M3, 128, backend="torch", **kwargs)
        _assert_same(block_cast_to_fp8(x, E4M3, 128, backend="triton", **kwargs), want, str(kwargs))
        _assert_same(block_cast_to_fp8(x, E4M3, 128, backend="torch", **kwargs), want, str(kwargs))


@pytest.mark.slow  # torch.compile takes tens of seconds on CPU
def test_compiles_without_graph_breaks():
    x = _input(16, 160, torch.float32)
    fn = torch.compile(lambda t: block_cast_to_fp8(t, E4M3, 128, rows=True, cols=True, backend="torch"),
                       backend="aot_eager", fullgraph=True)
    _assert_same(fn(x), block_cast_to_fp8(x, E4M3, 128, rows=True, cols=True, backend="torch"), "compiled")


@pytest.mark.parametrize("call,message", [
    (lambda x: block_cast_to_fp8(x[0], E4M3), "x must be a 2-D tensor"),
    (lambda x: block_cast_to_fp8(x.to(torch.int32), E4M3), "x has dtype torch.int32"),
    (lambda x: block_cast_to_fp8(x, torch.float16), "is not a supported FP8 dtype"),
    (lambda x: block_cast_to_fp8(x, E4M3, 64), r"block_size=64; allowed: \(32, 128\)"),
    (lambda x: block_cast_to_fp8(x, E4M3, rows=False), "nothing to compute"),
    (lambda x: block_cast_to_fp8(x, E4M3, amax_epsilon=-1.0), "amax_epsilon must be >= 0"),
])
def test_bad_input_raises(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(16, 32))


@requires_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_scale_from_amax_kernel_is_the_reference_on_edge_amaxes():
    """Per-tensor current scaling's scale in one launch: the same bits as the PyTorch rule for
    amaxes of 0, inf, NaN, fp32 subnormals, and ordinary values, with and without power-of-2
    scales and epsilon, for both FP8 maxima."""
    from tachyon.kernels.fp8_block_cast import scale_from_amax

    for amax in [0.0, float("inf"), float("nan"), 1e-45, 1e-40, 5e-4, 3.0, 447.0, 1e4, 3e38]:
        for fp8_max in (448.0, 57344.0):
            for pow2, eps in ((False, 0.0), (True, 0.0), (False, 1e-3)):
                t = torch.tensor(amax)
                want = scale_from_amax(t, fp8_max, power_2_scale=pow2, amax_epsilon=eps, backend="torch")
                got = scale_from_amax(t, fp8_max, power_2_scale=pow2, amax_epsilon=eps, backend="triton")
                for g, w in zip(got, want):
                    assert g.shape == () and torch.equal(g.view(torch.int32), w.view(torch.int32)), (amax, fp8_max, pow2, eps)
    with pytest.raises(ValueError, match="amax must be a 0-dim float32 tensor"):
        scale_from_amax(torch.ones(2), 448.0)
