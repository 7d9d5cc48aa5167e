"""The fused LayerNorm/RMSNorm op: Triton (interpreted on CPU, native on GPU) and the PyTorch path
against the autograd reference, forward and every gradient; the reference against torch/HF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tachyon
from tachyon.kernels.layernorm import layer_norm, reference, rms_norm
from tests.utils import assert_close, assert_close_to_reference

CPU_CASES = [("cpu", torch.float32), ("cpu", torch.float16)]
GPU_CASES = [pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.float16, torch.bfloat16)]
SHAPES = [(5, 123), (3, 1000), (2, 3, 64)]


def _inputs(shape, dtype, device, with_bias, with_residual):
    n = shape[-1]
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    # weights away from zero, as trained norms are (the invertible backward divides by them)
    w = torch.empty(n, device=device).uniform_(0.5, 1.5).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_() if with_bias else None
    r = torch.randn(shape, device=device).to(dtype).requires_grad_() if with_residual else None
    return x, w, b, r


def _run(fn, leaves, grad_y, grad_z):
    """Forward, then gradients of <y, grad_y> + <z, grad_z> for every leaf."""
    y, z = fn()
    loss = (y.float() * grad_y).sum() + (z.float() * grad_z).sum()
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return [y, z, *grads]


def _compare(is_rms, shape, device, dtype, with_bias, with_residual, invertible, backend):
    x, w, b, r = _inputs(shape, dtype, device, with_bias, with_residual)
    leaves = [x, w, b, r]
    grad_y = torch.randn(shape, device=device)
    grad_z = torch.randn(shape, device=device) if with_residual else torch.zeros(shape, device=device)

    def op(xx, ww, bb, rr):
        if is_rms:
            return rms_norm(xx, ww, rr, 1e-6, return_residual=True, invertible=invertible, backend=backend)
        return layer_norm(xx, ww, bb, rr, 1e-5, return_residual=True, invertible=invertible, backend=backend)

    def ref(xx, ww, bb, rr):
        if is_rms:
            return reference.rms_norm(xx, ww, rr, 1e-6)
        return reference.layer_norm(xx, ww, bb, rr, 1e-5)

    got = _run(lambda: op(*leaves), leaves, grad_y, grad_z)
    lowp = _run(lambda: ref(*leaves), leaves, grad_y, grad_z)
    leaves32 = [t.detach().float().requires_grad_() if t is not None else None for t in leaves]
    oracle = _run(lambda: ref(*leaves32), leaves32, grad_y, grad_z)
    names = ["y", "z"] + [n for n, t in zip(["dx", "dweight", "dbias", "dresidual"], leaves) if t is not None]
    for name, g, lo, o in zip(names, got, lowp, oracle):
        assert g.dtype == lo.dtype, f"{name}: dtype {g.dtype}, reference returns {lo.dtype}"
        if dtype == torch.float32:
            assert_close(g, o, name=name)
        else:
            assert_close_to_reference(g, lo, o, name=name)


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "noresidual"])
def test_layer_norm_triton_matches_reference(device, dtype, shape, with_bias, with_residual):
    _compare(False, shape, device, dtype, with_bias, with_residual, False, "triton")


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "noresidual"])
def test_rms_norm_triton_matches_reference(device, dtype, shape, with_residual):
    _compare(True, shape, device, dtype, False, with_residual, False, "triton")


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_invertible_backward_from_output_matches(device, dtype, is_rms, backend):
    _compare(is_rms, (5, 123), device, dtype, not is_rms, True, True, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "noresidual"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_torch_backend_explicit_backward_matches_autograd(dtype, shape, with_residual, is_rms):
    _compare(is_rms, shape, "cpu", dtype, not is_rms, with_residual, False, "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_torch_layer_norm(dtype):
    """fp32: equal within the table; fp16/bf16: no further from the fp32 oracle than 2x torch's own error."""
    x32 = torch.randn(7, 129)
    w32, b32 = torch.randn(129), torch.randn(129)
    g = torch.randn(7, 129)

    def run(fn, dt):
        x, w, b = (t.to(dt).requires_grad_() for t in (x32, w32, b32))
        y = fn(x, w, b)
        return [y, *torch.autograd.grad(y.float(), [x, w, b], g)]

    ours = run(lambda x, w, b: reference.layer_norm(x, w, b, None, 1e-5)[0], dtype)
    theirs = run(lambda x, w, b: F.layer_norm(x, (129,), w, b, 1e-5), dtype)
    oracle = run(lambda x, w, b: F.layer_norm(x, (129,), w, b, 1e-5), torch.float64)
    for name, a, e, o in zip(["y", "dx", "dweight", "dbias"], ours, theirs, oracle):
        if dtype == torch.float32:
            assert_close(a, e, atol=1e-4 if name != "y" else None, name=name)  # 7-row sums, reordered
        else:
            assert_close_to_reference(a, e, o, name=name)


def test_reference_rms_norm_matches_hf_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 9, 96)
    y, _ = reference.rms_norm(x, hf.weight, None, 1e-6)
    assert_close(y, hf(x), name="y")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_traces_the_op(backend):
    x = torch.randn(6, 40, requires_grad=True)
    w = torch.rand(40).add_(0.5).requires_grad_()
    b = torch.randn(40, requires_grad=True)
    r = torch.randn(6, 40, requires_grad=True)

    def f(x, w, b, r):
        y, z = layer_norm(x, w, b, r, return_residual=True, backend=backend)
        return (rms_norm(y, w, backend=backend) * z).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(x, w, b, r)
    grads = torch.autograd.grad(got, [x, w, b, r])
    want = f(x, w, b, r)
    want_grads = torch.autograd.grad(want, [x, w, b, r])
    assert_close(got, want, name="loss")
    for name, a, e in zip(["dx", "dw", "db", "dr"], grads, want_grads):
        assert_close(a, e, name=name)


def test_torch_compile_with_inductor_on_cpu():
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.rand(32).add_(0.5).requires_grad_()

    def f(x, w):
        return (layer_norm(x, w, None, None, backend="torch") ** 2).sum()

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, w)
    assert_close(got, f(x, w), name="loss")


def test_invertible_does_not_keep_the_input_for_backward():
    x = torch.randn(4, 64, requires_grad=True)
    r = torch.randn(4, 64, requires_grad=True)
    w = torch.rand(64).add_(0.5).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    for invertible in (False, True):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, z = layer_norm(x, w, None, r, return_residual=True, invertible=invertible, backend="torch")
        z_ptr, y_ptr = z.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()
        assert (z_ptr in saved) != invertible, f"invertible={invertible}: z saved? {z_ptr in saved}"
        assert (y_ptr in saved) == invertible


def test_auto_backend_runs_the_reference_on_cpu_tensors():
    from tachyon.backend import resolve

    x = torch.randn(2, 8)
    assert resolve(x) == "torch"
    with tachyon.use_backend("triton"):
        assert resolve(x) == "triton"  # CPU tensors take Triton only under the interpreter (tests)
        with tachyon.use_backend("torch"):
            assert resolve(x) == "torch"
        assert resolve(x) == "triton"
    assert tachyon.get_backend() == "auto"
    assert resolve(x, "torch") == "torch"


def test_bad_backend_name_is_a_value_error():
    with pytest.raises(ValueError, match=r"backend='cuda-fast' is not a tachyon backend; allowed: 'auto', 'triton', 'torch'"):
        tachyon.set_backend("cuda-fast")
    with pytest.raises(ValueError, match="allowed"):
        with tachyon.use_backend("cuda"):
            pass
    with pytest.raises(ValueError, match="backend='gpu'"):
        layer_norm(torch.randn(2, 4), torch.ones(4), backend="gpu")


def test_bad_inputs_name_the_argument_and_what_is_allowed():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"layer_norm: weight has shape \(15,\); expected \(16,\)"):
        layer_norm(x, torch.ones(15))
    with pytest.raises(ValueError, match=r"rms_norm: x has dtype torch.float64.*allowed: float32, float16, bfloat16"):
        rms_norm(x.double(), torch.ones(16))
    with pytest.raises(ValueError, match=r"layer_norm: x has dtype torch.int64"):
        layer_norm(torch.ones(3, 16, dtype=torch.long), torch.ones(16))
    with pytest.raises(ValueError, match=r"residual has shape \(3, 8\); expected \(3, 16\)"):
        layer_norm(x, torch.ones(16), residual=torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"residual has dtype torch.float16 but x has torch.float32"):
        layer_norm(x, torch.ones(16), residual=x.half())


_AOT_SCRIPT = """
from tests.utils.aot import compile_sm90
from tachyon.kernels.layernorm import triton as tri

fp32 = {"MEAN", "RSTD", "DW_PART", "DB_PART"}
for kernel, consts in (
    (tri._norm_fwd_kernel, dict(IS_RMS=False, HAS_RES=True, HAS_BIAS=True, STORE_Z=True, BLOCK_N=4096)),
    (tri._norm_fwd_kernel, dict(IS_RMS=True, HAS_RES=False, HAS_BIAS=False, STORE_Z=False, BLOCK_N=8192)),
    (tri._norm_bwd_kernel, dict(IS_RMS=False, HAS_BIAS=True, HAS_DZ_OUT=True, FROM_OUTPUT=False, BLOCK_N=4096)),
    (tri._norm_bwd_kernel, dict(IS_RMS=True, HAS_BIAS=False, HAS_DZ_OUT=False, FROM_OUTPUT=True, BLOCK_N=8192)),
):
    types = {n: "*fp32" if n in fp32 else "*bf16" for n in kernel.arg_names
             if n.isupper() and n not in ("N", "M") and n not in consts}  # pointers; ints default to i32
    types.update({"eps": "fp32"} if "eps" in kernel.arg_names else {})
    compile_sm90(kernel, types, consts, num_warps=min(max(consts["BLOCK_N"] // 256, 1), 16))

from tachyon.kernels import tiling  # the backward's partial sums: (column block, group) programs

compile_sm90(tiling._sum_partials_kernel, {"PART": "*fp32", "OUT0": "*bf16", "OUT1": "*bf16", "OUT2": "*fp32",
             "P": "i32", "N": "i32"}, dict(BLOCK_P=128, BLOCK_N=32), num_warps=4)
# a layer backward's reductions in one launch: five segments of different blocks
segment_types = {}
for k in "ABCDE":
    segment_types.update({f"{k}_PART": "*fp32", f"{k}_OUT0": "*bf16", f"{k}_OUT1": "*bf16", f"{k}_OUT2": "*fp32"})
blocks = dict(A_BP=128, A_BN=32, B_BP=32, B_BN=128, C_BP=64, C_BN=64, D_BP=4, D_BN=1024, E_BP=128, E_BN=32)
compile_sm90(tiling._sum_segments_kernel, segment_types, dict(SEGMENTS=5, **blocks), num_warps=4)
"""


def test_kernels_compile_for_an_h100_without_a_gpu():
    """The interpreter never runs Triton's compiler: build the GPU path (TTIR -> PTX -> cubin with
    Triton's bundled ptxas) for compute capability 9.0 in bf16, both norms, every flag, and the
    kernel that sums the backward's partial rows."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=6)


@pytest.mark.parametrize("n,groups,sms,expected", [
    (1024, 2, 132, 32),     # BERT-Large's LayerNorm: 32 column blocks x 2 groups, not 1 x 2
    (4096, 1, 132, 32),     # an FFN bias: 128 programs
    (16384, 1, 132, 128),   # wide rows: 128 programs of 128 columns
    (100, 3, 132, 32),      # narrow rows: never under one 128-byte line per row
    (16, 1, 132, 16),       # rows narrower than a line: one block
    (1 << 20, 1, 132, 1024),  # never wider than 1024
])
def test_partial_sums_fill_the_gpu(monkeypatch, n, groups, sms, expected):
    """On a GPU the partial-row sums use narrow column blocks so that (column block, group)
    programs fill the SMs; under the interpreter, few wide ones."""
    from tachyon.kernels import tiling

    assert tiling.sum_block_n(n, groups, torch.device("cpu")) == min(triton_next_pow2(n), 1024)
    monkeypatch.setattr(tiling, "INTERPRETER_AS_SMS", sms)
    assert tiling.sum_block_n(n, groups, torch.device("cpu")) == expected


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_sum_partials_matches_torch(monkeypatch, groups):
    """Every group's column sums, with the GPU's narrow blocks as well as the interpreter's."""
    from tachyon.kernels import tiling

    part = torch.randn(37, groups * 300)
    dtypes = [torch.float32, torch.bfloat16, torch.float16][:groups]
    for sms in (None, 132):
        monkeypatch.setattr(tiling, "INTERPRETER_AS_SMS", sms)
        outs = tiling.sum_partials(part, dtypes)
        for g, (out, dt) in enumerate(zip(outs, dtypes)):
            ref = part[:, g * 300:(g + 1) * 300].sum(0)
            assert out.dtype == dt
            torch.testing.assert_close(out, ref.to(dt), rtol=1e-5 if dt == torch.float32 else 1e-2, atol=1e-5)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
