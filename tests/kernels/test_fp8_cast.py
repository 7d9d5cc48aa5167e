"""The fused FP8 cast + amax (+ transpose): the integer-arithmetic reference against PyTorch's own
FP8 conversion (every fp16 bit pattern, rounding ties, saturation, subnormals, NaN), the Triton
kernels (interpreted on CPU, native on GPU) bit for bit against the reference, amax updates and
their NaN/inf propagation, torch.compile, and bad input.

Every comparison here is exact (bit patterns, amax values): the op promises bit-identity with
``(x.float() * scale).clamp(-m, m).to(fp8_dtype)``, so the tolerance table does not apply.
"""

from __future__ import annotations

import pytest
import torch

import tachyon
from tachyon.kernels.fp8_cast import FP8_DTYPES, FP8_MAX, cast_to_fp8, reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_IDS = ["e4m3", "e5m2"]
# NaN/inf inputs times the scale: numpy (under Triton's interpreter) warns "invalid value"; expected
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
# scales that keep values in range, push them into FP8 subnormals or below, saturate them, and
# make products that are not powers of two (so rounding ties and carries are all exercised)
SCALES = [1.0, 2.0**-10, 2.0**-20, 2.0**10, 1e5, 0.3, 7.77, -0.75, 0.0]


# The oracle: what tachyon.fp8's multi-pass cast computes, with PyTorch's own conversion.
_torch_cast = reference.cast_to_fp8_torch


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor | None = None, name: str = "x8"):
    """Exact equality of FP8 (or uint8) tensors; on mismatch: count, first index, input, codes."""
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.is_contiguous(), f"{name}: not contiguous (strides {got.stride()})"
    g, w = got.cpu().view(torch.uint8).reshape(-1), want.cpu().view(torch.uint8).reshape(-1)
    bad = (g != w).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        src = f" (input {inputs.reshape(-1)[i].item()!r})" if inputs is not None and inputs.numel() == g.numel() else ""
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), got.shape)) if got.dim() else ()
        raise AssertionError(
            f"{name}: {bad.numel()} of {g.numel()} FP8 codes differ; first at index {idx}{src}: "
            f"got 0x{int(g[i]):02x} ({g[i:i + 1].view(got.dtype).float().item()}), "
            f"expected 0x{int(w[i]):02x} ({w[i:i + 1].view(want.dtype).float().item()})"
        )


def _assert_same_amax(got: torch.Tensor, want: torch.Tensor, name: str = "amax"):
    assert got.dtype == torch.float32 and got.dim() == 0, f"{name}: {got.dtype} of shape {tuple(got.shape)}"
    g, w = got.item(), want.item()
    same = (g != g and w != w) or g == w
    assert same, f"{name}: got {g!r}, expected {w!r}"


def _all_fp16() -> torch.Tensor:
    """Every fp16 bit pattern (NaNs, infs, subnormals, +-0 included), 65536 values."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)


# --- the reference's integer conversion against PyTorch's ---------------------------------------

@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_reference_matches_torch_on_every_fp16_bit_pattern(fp8_dtype):
    x = _all_fp16()
    for s in SCALES:
        scale = torch.tensor(s)
        _assert_same_bits(reference.cast_to_fp8(x, scale, fp8_dtype), _torch_cast(x, scale, fp8_dtype), x,
                          name=f"scale={s}")


def _fp8_boundary_values(fp8_dtype: torch.dtype) -> torch.Tensor:
    """For every pair of neighbouring non-negative finite FP8 values: the exact midpoint (a tie)
    and the fp32 values one ulp either side of it; plus values around fp8_max, far beyond it,
    the subnormal/normal boundary, +-0, +-inf and NaNs of both signs, all with both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(fp8_dtype).float()
    codes = codes[torch.isfinite(codes)]  # E5M2 0x7C.. are inf/NaN
    lo, hi = codes[:-1], codes[1:]
    mid = (lo + hi) / 2  # exact in fp32
    below = torch.nextafter(mid, torch.zeros_like(mid))
    above = torch.nextafter(mid, torch.full_like(mid, float("inf")))
    m = FP8_MAX[fp8_dtype]
    top = torch.tensor([m, m * 1.0625, m * 1.125, m * 1.5, m * 2, 3.4e38, float("inf"), -7.8559, 1e-45, 2e-38])
    top = torch.cat([top, torch.nextafter(torch.tensor([m]), torch.tensor([float("inf")]))])
    nans = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, -0x00000001], dtype=torch.int32).view(torch.float32)
    vals = torch.cat([codes, mid, below, above, top])
    return torch.cat([vals, -vals, nans])


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_reference_ties_saturation_subnormals_and_nan(fp8_dtype):
    x = _fp8_boundary_values(fp8_dtype)
    one = torch.tensor(1.0)
    got = reference.cast_to_fp8(x, one, fp8_dtype)
    _assert_same_bits(got, _torch_cast(x, one, fp8_dtype), x)
    # the spot checks that the tables above rest on
    codes = got.view(torch.uint8)
    assert int(codes[x == -7.8559][0]) == (0xD0 if fp8_dtype == E4M3 else 0xC8)  # -8.0: the carry case
    assert int(codes[x == float("inf")][0]) == (0x7E if fp8_dtype == E4M3 else 0x7B)  # saturates to +max
    assert int(codes[x == float("-inf")][0]) == (0xFE if fp8_dtype == E4M3 else 0xFB)
    assert {int(c) for c in codes[-4:]} == {0x7F, 0xFF}  # NaN keeps its sign bit
    assert int(reference.cast_to_fp8(torch.tensor(-0.0), one, fp8_dtype).view(torch.uint8)) == 0x80


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_reference_matches_torch_on_random_fp32_bits_and_values(fp8_dtype):
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32).view(torch.float32)
    one = torch.tensor(1.0)
    _assert_same_bits(reference.cast_to_fp8(bits, one, fp8_dtype), _torch_cast(bits, one, fp8_dtype), bits)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(300, 257) * torch.logspace(-8, 8, 257)).to(dtype)
        for s in (1.0, 0.3, 37.0):
            scale = torch.tensor(s)
            _assert_same_bits(reference.cast_to_fp8(x, scale, fp8_dtype), _torch_cast(x, scale, fp8_dtype), x,
                              name=f"{dtype} scale={s}")


def test_reference_amax_and_transpose():
    x = torch.randn(7, 5) * 3
    amax = torch.tensor(0.25)
    x8, x8_t = reference.cast_to_fp8(x, torch.tensor(2.0), E4M3, amax, transpose=True)
    _assert_same_amax(amax, x.abs().max())
    _assert_same_bits(x8_t, x8.t().contiguous(), name="x8_t")
    row = torch.randn(1, 6)
    r8, r8_t = reference.cast_to_fp8(row, torch.tensor(1.0), E4M3, transpose=True)
    assert r8_t.shape == (6, 1) and r8_t.untyped_storage().data_ptr() != r8.untyped_storage().data_ptr()
    big = torch.tensor(1e6)
    reference.cast_to_fp8(x, torch.tensor(2.0), E4M3, big)
    _assert_same_amax(big, torch.tensor(1e6))  # a larger recorded amax is kept


# --- the Triton kernels (interpreter on CPU) against the reference ------------------------------

X_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(37, 53), (64, 32), (1, 1), (3, 1000), (2, 3, 17), (129,)]


def _input(shape, dtype, device):
    """randn spread over 16 binades, with +-0 and values that land on FP8 ties and subnormals."""
    x = torch.randn(shape, device=device) * 2.0 ** torch.randint(-8, 8, shape, device=device).float()
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 0.3125, -2.0**-9, 448.0, 2e4, 1e-5], device=device)
    flat[: min(flat.numel(), specials.numel())] = specials[: flat.numel()]
    return x.to(dtype)


def _compare_with_reference(x, scale, fp8_dtype, transpose, amax0=0.5):
    a_tri, a_ref = torch.tensor(amax0, device=x.device), torch.tensor(amax0, device=x.device)
    got = cast_to_fp8(x, scale, fp8_dtype, a_tri, transpose=transpose, backend="triton")
    want = reference.cast_to_fp8(x, scale, fp8_dtype, a_ref, transpose=transpose)
    if transpose:
        _assert_same_bits(got[0], want[0], x)
        _assert_same_bits(got[1], want[1], name="x8_t")
        _assert_same_bits(got[1], got[0].t().contiguous(), name="x8_t vs x8.T")
    else:
        _assert_same_bits(got, want, x)
    _assert_same_amax(a_tri, a_ref)
    return got


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape, dtype, fp8_dtype):
    x = _input(shape, dtype, "cpu")
    scale = torch.tensor(13.5)
    _compare_with_reference(x, scale, fp8_dtype, transpose=False)
    if x.dim() == 2:
        _compare_with_reference(x, scale, fp8_dtype, transpose=True)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
def test_triton_on_every_fp16_bit_pattern(fp8_dtype, transpose):
    """All 65536 fp16 values (NaN and inf included: amax must come out NaN) through either kernel."""
    x = _all_fp16().reshape(256, 256)
    for s in (1.0, 2.0**-12, 300.0):
        got = _compare_with_reference(x, torch.tensor(s), fp8_dtype, transpose)
        x8 = got[0] if transpose else got
        _assert_same_bits(x8, _torch_cast(x, torch.tensor(s), fp8_dtype), x, name=f"vs torch, scale={s}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_transpose_of_strided_inputs(backend):
    """x a transposed view, and a column slice: the tile kernel reads any strides."""
    base = _input((40, 70), torch.float16, "cpu")
    for x in (base.t(), base[:, 3:60]):
        a = torch.tensor(0.0)
        x8, x8_t = cast_to_fp8(x, torch.tensor(4.0), E5M2, a, transpose=True, backend=backend)
        want = _torch_cast(x, torch.tensor(4.0), E5M2)
        _assert_same_bits(x8, want, x)
        _assert_same_bits(x8_t, want.t().contiguous(), name="x8_t")
        _assert_same_amax(a, x.float().abs().max())
    y = cast_to_fp8(base.t(), torch.tensor(4.0), E4M3, backend=backend)  # non-contiguous, no transpose
    _assert_same_bits(y, _torch_cast(base.t(), torch.tensor(4.0), E4M3))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("transpose", [False, True], ids=["flat", "transpose"])
def test_amax_propagates_nan_and_inf(backend, transpose):
    def run(x, old):
        a = torch.tensor(old)
        cast_to_fp8(x, torch.tensor(1.0), E4M3, a, transpose=transpose, backend=backend)
        return a

    x = torch.randn(33, 65)
    assert run(x, 0.0).item() == x.abs().max().item()
    assert run(x, 1e9).item() == 1e9  # an older, larger amax stays
    x_inf = x.clone()
    x_inf[20, 50] = -float("inf")
    assert run(x_inf, 0.0).item() == float("inf")
    x_nan = x_inf.clone()
    x_nan[31, 1] = float("nan")  # a NaN beats the inf, in any program
    assert torch.isnan(run(x_nan, 0.0))
    assert torch.isnan(run(x_nan.half(), 0.0))
    neg_nan = torch.tensor(-0x00400000, dtype=torch.int32).view(torch.float32).item()
    for old in (float("nan"), neg_nan):  # a NaN already recorded stays NaN (torch.maximum keeps it)
        assert torch.isnan(run(x, old)), f"old amax bits {torch.tensor(old).view(torch.int32).item():#x}"
    a = torch.tensor(3.0)
    out = cast_to_fp8(torch.empty(0, 16), torch.tensor(1.0), E4M3, a, transpose=transpose, backend=backend)
    assert (out[1].shape if transpose else out.shape) == ((16, 0) if transpose else (0, 16))
    assert a.item() == 3.0  # nothing to record


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_amax_may_be_a_slot_of_an_amax_history(backend):
    """tachyon.fp8's ScalingState records into amax_history[0], a 0-dim view: the op writes through it."""
    history = torch.tensor([0.5, 7.0, 9.0])
    x = torch.randn(16, 48)
    cast_to_fp8(x, torch.tensor(1.0), E4M3, history[0], transpose=True, backend=backend)
    cast_to_fp8(x * 3, torch.tensor(1.0), E4M3, history[0], backend=backend)
    assert history.tolist() == [(3 * x).abs().max().item(), 7.0, 9.0]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_without_amax_and_with_requires_grad(backend):
    x = torch.randn(9, 31, requires_grad=True)
    scale = torch.tensor(0.5)
    x8 = cast_to_fp8(x, scale, E5M2, backend=backend)
    assert not x8.requires_grad
    _assert_same_bits(x8, _torch_cast(x.detach(), scale, E5M2), x)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_torch_compile_traces_the_op_and_its_amax_update(backend):
    x = torch.randn(24, 40)
    scale = torch.tensor(8.0)

    def f(x, scale, amax):
        x8, x8_t = cast_to_fp8(x * 2, scale, E4M3, amax, transpose=True, backend=backend)
        return x8.float().sum(), x8_t

    torch._dynamo.reset()
    amax_c, amax_e = torch.tensor(0.0), torch.tensor(0.0)
    got_sum, got_t = torch.compile(f, backend="aot_eager", fullgraph=True)(x, scale, amax_c)
    want_sum, want_t = f(x, scale, amax_e)
    assert got_sum.item() == want_sum.item()
    _assert_same_bits(got_t, want_t, name="x8_t")
    _assert_same_amax(amax_c, amax_e)
    _assert_same_amax(amax_c, (2 * x).abs().max())


# --- bad input ----------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument_and_what_is_allowed():
    x, s, a = torch.randn(4, 8), torch.tensor(1.0), torch.tensor(0.0)
    with pytest.raises(ValueError, match=r"fp8_dtype=torch.float16 is not a supported FP8 dtype; allowed: "
                                         r"torch.float8_e4m3fn, torch.float8_e5m2"):
        cast_to_fp8(x, s, torch.float16)
    with pytest.raises(ValueError, match=r"fp8_dtype=torch.float8_e4m3fnuz"):
        cast_to_fp8(x, s, torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match=r"x has dtype torch.float64.*allowed: float32, float16, bfloat16"):
        cast_to_fp8(x.double(), s, E4M3)
    with pytest.raises(ValueError, match=r"scale must be a 0-dim float32 tensor; got a torch.float32 tensor of shape \(1,"):
        cast_to_fp8(x, s.reshape(1), E4M3)
    with pytest.raises(ValueError, match=r"scale must be a 0-dim float32 tensor; got a torch.float16 tensor"):
        cast_to_fp8(x, s.half(), E4M3)
    with pytest.raises(ValueError, match=r"scale must be a 0-dim float32 tensor; got float"):
        cast_to_fp8(x, 1.0, E4M3)
    with pytest.raises(ValueError, match=r"amax must be a 0-dim float32 tensor; got a torch.float32 tensor of shape \(16,"):
        cast_to_fp8(x, s, E4M3, torch.zeros(16))
    with pytest.raises(ValueError, match=r"amax must be a 0-dim float32 tensor; got a torch.bfloat16"):
        cast_to_fp8(x, s, E4M3, a.bfloat16())
    with pytest.raises(ValueError, match=r"transpose=True needs a 2-D x \[M, N\]; got shape \(2, 2, 8\)"):
        cast_to_fp8(x.reshape(2, 2, 8), s, E4M3, transpose=True)
    with pytest.raises(ValueError, match=r"all tensors must be on one device; got x on cpu, scale on meta"):
        cast_to_fp8(x, s.to("meta"), E4M3)
    with pytest.raises(ValueError, match=r"x on cpu, scale on cpu, amax on meta"):
        cast_to_fp8(x, s, E4M3, a.to("meta"))
    with pytest.raises(ValueError, match=r"backend='gpu' is not a tachyon backend"):
        cast_to_fp8(x, s, E4M3, backend="gpu")
    with pytest.raises(ValueError, match=r"transpose must be True or False"):
        cast_to_fp8(x, s, E4M3, transpose=1)
    from tachyon.kernels.fp8_cast.triton import MAX_GRID_Y, tile_config

    too_wide = MAX_GRID_Y * tile_config(x.device)[1] + 1  # more column tiles than a CUDA grid holds
    with pytest.raises(ValueError, match=rf"at most {too_wide - 1} columns; got {too_wide} \(use backend='torch'\)"):
        cast_to_fp8(torch.empty(1, too_wide, dtype=torch.float16), s, E4M3, transpose=True, backend="triton")


def test_auto_backend_on_cpu_is_the_reference():
    from tachyon.backend import resolve

    x = torch.randn(4, 4)
    assert resolve(x) == "torch"
    with tachyon.use_backend("triton"):
        assert resolve(x) == "triton"


# --- GPU (run later by benchmarks/gpu.sh) -------------------------------------------------------

GPU_SHAPES = [(8192, 4096), (4096, 16384), (4097, 1031), (3, 5, 77)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_triton_matches_reference_and_torch(shape, dtype, fp8_dtype):
    x = _input(shape, dtype, "cuda")
    x.view(-1)[-1] = float("nan") if dtype != torch.float32 else x.view(-1)[-1]
    scale = torch.tensor(13.5, device="cuda")
    got = _compare_with_reference(x, scale, fp8_dtype, transpose=len(shape) == 2)
    x8 = got[0] if len(shape) == 2 else got
    _assert_same_bits(x8, _torch_cast(x, scale, fp8_dtype), x, name="vs torch")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_gpu_every_fp16_bit_pattern_and_auto_backend(fp8_dtype):
    x = _all_fp16().reshape(256, 256).cuda()
    for s in SCALES:
        _compare_with_reference(x, torch.tensor(s, device="cuda"), fp8_dtype, transpose=True)
    scale = torch.tensor(3.0, device="cuda")
    _assert_same_bits(cast_to_fp8(x, scale, fp8_dtype), _torch_cast(x, scale, fp8_dtype), x)  # auto = triton


@pytest.mark.gpu
def test_gpu_amax_is_deterministic_and_propagates_nan():
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    amaxes = set()
    for _ in range(5):
        a = torch.zeros((), device="cuda")
        cast_to_fp8(x, torch.tensor(1.0, device="cuda"), E4M3, a, transpose=True)
        amaxes.add(a.item())
    assert amaxes == {x.float().abs().max().item()}
    x[5000, 17] = float("nan")
    a = torch.zeros((), device="cuda")
    cast_to_fp8(x, torch.tensor(1.0, device="cuda"), E4M3, a)
    assert torch.isnan(a)


# --- the GPU build, checked without a GPU -------------------------------------------------------

_AOT_SCRIPT = """
import torch
from tests.utils.aot import compile_sm90
from tachyon.kernels.fp8_cast import triton as tri

cuda = torch.device("cuda")
block, flat_warps = tri.flat_config(cuda)
block_m, block_n, tile_warps = tri.tile_config(cuda)
for fp8, x_type, has_amax in ((torch.float8_e4m3fn, "*bf16", True), (torch.float8_e5m2, "*fp32", False)):
    c = tri._format_constexprs(fp8)
    common = {"X": x_type, "SCALE": "*fp32", "OUT": "*u8", "AMAX": "*i32"}
    compile_sm90(tri._cast_flat_kernel, dict(common, numel="i64"), dict(c, HAS_AMAX=has_amax, BLOCK=block),
                 num_warps=flat_warps, aligned_ints=("numel",))
    compile_sm90(tri._cast_transpose_kernel, dict(common, OUT_T="*u8"),
                 dict(c, HAS_AMAX=has_amax, ROW_CONTIGUOUS=has_amax, BLOCK_M=block_m, BLOCK_N=block_n),
                 num_warps=tile_warps, aligned_ints=("M", "N", "stride_xm"))
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never runs Triton's compiler: build both kernels (TTIR -> PTX -> cubin with the
    bundled ptxas) for compute capability 9.0, E4M3 from bf16 with amax and a row-contiguous x, E5M2
    from fp32 without amax and a strided x."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=4)
