"""FP8 casts and the FP8 GEMM: saturating casts, exact emulation, the multiple-of-16 rule, and
(GPU, compute capability >= 8.9) the native torch._scaled_mm path against the emulation."""

from __future__ import annotations

import pytest
import torch

from tachyon.fp8 import cast_from_fp8, cast_to_fp8, fp8_gemm, native_fp8_supported
from tests.utils import assert_close

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ONE = torch.tensor(1.0)


@pytest.mark.parametrize("fp8_dtype,fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_cast_saturates_instead_of_overflowing(fp8_dtype, fp8_max):
    x = torch.tensor([1e6, -1e6, 1.0, float("nan")])
    x8 = cast_to_fp8(x, ONE, fp8_dtype)
    assert x8.dtype == fp8_dtype
    back = cast_from_fp8(x8, ONE)
    assert back[:3].tolist() == [fp8_max, -fp8_max, 1.0]
    assert torch.isnan(back[3])
    if fp8_dtype == E5M2:  # what saturation protects against: a plain cast overflows to inf
        assert torch.isinf(x[:1].to(E5M2).float()).all()


def test_cast_applies_scale_and_cast_back_applies_scale_inv():
    values = torch.tensor([0.5, -1.5, 3.0, 240.0])  # exactly representable in E4M3
    scale = torch.tensor(4.0)
    x8 = cast_to_fp8(values / 4.0, scale, E4M3)
    assert cast_from_fp8(x8, ONE).tolist() == values.tolist()
    assert cast_from_fp8(x8, 1 / scale, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(cast_from_fp8(x8, 1 / scale), values / 4.0)


def test_cast_rounds_to_the_nearest_fp8_value():
    x = torch.linspace(-3, 3, 1001)
    back = cast_from_fp8(cast_to_fp8(x, ONE, E4M3), ONE)
    # E4M3 keeps 3 mantissa bits: relative rounding error at most 2**-4 for normal numbers
    assert ((back - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10).all()


@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E5M2)])
@pytest.mark.parametrize("m,n,k", [(16, 32, 48), (48, 16, 80)], ids=str)
def test_emulated_gemm_is_the_matmul_of_the_dequantized_operands(a_dtype, b_dtype, m, n, k):
    sa, sb = torch.tensor(8.0), torch.tensor(0.5)
    a8 = cast_to_fp8(torch.randn(m, k), sa, a_dtype)
    b8 = cast_to_fp8(torch.randn(n, k), sb, b_dtype)
    out = fp8_gemm(a8, 1 / sa, b8, 1 / sb, torch.float32, native=False)
    oracle = (a8.double() / 8.0) @ (b8.double() / 0.5).t()
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_close(out, oracle.float(), name="fp8_gemm")  # products of FP8 values are exact in fp32
    out_bf16 = fp8_gemm(a8, 1 / sa, b8, 1 / sb, torch.bfloat16, native=False)
    assert out_bf16.dtype == torch.bfloat16
    assert_close(out_bf16, oracle.float(), dtype=torch.bfloat16, name="fp8_gemm bf16")


def test_gemm_takes_transposed_views():
    at = cast_to_fp8(torch.randn(32, 16), ONE, E4M3).t()  # [16, 32], non-contiguous
    bt = cast_to_fp8(torch.randn(32, 48), ONE, E4M3).t()  # [48, 32], non-contiguous
    out = fp8_gemm(at, ONE, bt, ONE, torch.float32, native=False)
    assert_close(out, (at.double() @ bt.double().t()).float(), name="fp8_gemm on views")


@pytest.mark.parametrize("shapes,name", [(((10, 32), (16, 32)), "M=10"), (((16, 32), (24, 32)), "N=24"),
                                         (((16, 40), (16, 40)), "K=40")])
def test_dimensions_must_be_multiples_of_16(shapes, name):
    a8, b8 = (cast_to_fp8(torch.randn(s), ONE, E4M3) for s in shapes)
    with pytest.raises(ValueError, match=f"fp8_gemm: {name} is not a multiple of 16; FP8 GEMMs need every dimension"):
        fp8_gemm(a8, ONE, b8, ONE, torch.float32)


def test_bad_operands_raise_value_errors():
    a8 = cast_to_fp8(torch.randn(16, 32), ONE, E4M3)
    with pytest.raises(ValueError, match="b has dtype torch.float32; expected an FP8 dtype"):
        fp8_gemm(a8, ONE, torch.randn(16, 32), ONE, torch.float32)
    with pytest.raises(ValueError, match=r"second dims \(K\) must match"):
        fp8_gemm(a8, ONE, cast_to_fp8(torch.randn(16, 48), ONE, E4M3), ONE, torch.float32)
    with pytest.raises(ValueError, match="cast_to_fp8: fp8_dtype=torch.float16 is not an FP8 dtype"):
        cast_to_fp8(torch.randn(4), ONE, torch.float16)
    if not native_fp8_supported(a8.device):
        with pytest.raises(ValueError, match="native=True needs a CUDA device of compute capability >= 8.9"):
            fp8_gemm(a8, ONE, a8, ONE, torch.float32, native=True)


def _needs_native_fp8():
    if not torch.cuda.is_available() or not native_fp8_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9) for torch._scaled_mm")


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_scaled_mm_matches_the_emulation(a_dtype, out_dtype):
    _needs_native_fp8()
    sa, sb = torch.tensor(4.0, device="cuda"), torch.tensor(0.25, device="cuda")
    a8 = cast_to_fp8(torch.randn(64, 96, device="cuda"), sa, a_dtype)
    b8 = cast_to_fp8(torch.randn(48, 96, device="cuda"), sb, E4M3)
    native = fp8_gemm(a8, 1 / sa, b8, 1 / sb, out_dtype, native=True)
    emulated = fp8_gemm(a8, 1 / sa, b8, 1 / sb, out_dtype, native=False)
    assert native.dtype == out_dtype
    # same products, fp32 accumulation in another order: the output dtype's tolerance (atol for fp32 sums)
    assert_close(native, emulated, atol=1e-4 if out_dtype == torch.float32 else None, name="native vs emulated")
    # and the transposed operands the backward passes (dgrad / wgrad layouts)
    g8 = cast_to_fp8(torch.randn(64, 48, device="cuda"), ONE.cuda(), E5M2)
    dgrad = fp8_gemm(g8, ONE.cuda(), b8.t(), 1 / sb, out_dtype, native=True)
    assert_close(dgrad, fp8_gemm(g8, ONE.cuda(), b8.t(), 1 / sb, out_dtype, native=False),
                 atol=1e-4 if out_dtype == torch.float32 else None, name="dgrad layout")


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cast_records_amax_and_writes_the_transpose_on_either_backend(fp8_dtype, backend):
    """tachyon.fp8.cast_to_fp8 runs the fused Triton op where the backend is Triton (here under the
    interpreter) and PyTorch's cast elsewhere: the same bits, the same amax, the same transpose."""
    import tachyon

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(48, 33, generator=gen) * 50).to(torch.bfloat16)
    scale = torch.tensor(3.0)
    m = 448.0 if fp8_dtype == E4M3 else 57344.0
    want = (x.float() * scale).clamp(-m, m).to(fp8_dtype)
    history = torch.tensor([2.0, 1e9])
    with tachyon.use_backend(backend):
        x8, x8_t = cast_to_fp8(x, scale, fp8_dtype, history[0], transpose=True)
        plain = cast_to_fp8(x, scale, fp8_dtype)
    assert torch.equal(x8.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(plain.view(torch.uint8), want.view(torch.uint8))
    assert x8_t.is_contiguous() and torch.equal(x8_t.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert history.tolist() == [x.float().abs().max().item(), 1e9]  # only the newest slot, in place


def test_transposed_saved_operands_give_the_same_step_as_the_plain_ones(monkeypatch):
    """Where torch._scaled_mm runs, the FP8 linear saves x8.T / w8.T (written by the casts) for the
    backward GEMMs instead of x8 / w8. Forced on here (emulated GEMMs): outputs, gradients and the
    recorded amaxes equal the untransposed path's, with a cached weight too."""
    import tachyon
    import tachyon.nn
    from tachyon.fp8 import linear as fp8_linear_module

    def run(transposed: bool):
        monkeypatch.setattr(fp8_linear_module, "transposed_operands", lambda device: transposed)
        torch.manual_seed(0)
        layer = tachyon.nn.Linear(32, 48, params_dtype=torch.float32)
        outs, grads = [], []
        for step in range(3):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
            with tachyon.fp8_autocast(enabled=True):
                y = layer(x, is_first_microbatch=None if step == 0 else step == 1)
            (y.float() * torch.linspace(-1, 1, 48)).sum().backward()
            outs.append(y.detach())
            grads.append(x.grad)
        return outs, grads, layer.weight.grad, layer.bias.grad, layer.fp8_state_dict()

    plain, transposed = run(False), run(True)
    for a, b in zip(plain[0] + plain[1] + [plain[2], plain[3]], transposed[0] + transposed[1] + [transposed[2], transposed[3]]):
        assert_close(b, a, atol=1e-6, rtol=1e-6)
    for gemm, roles in plain[4]["gemms"].items():
        for role, state in roles.items():
            for key, value in state.items():
                assert torch.equal(transposed[4]["gemms"][gemm][role][key], value), (gemm, role, key)
