"""bias + dropout + residual (+ LayerNorm/RMSNorm): Triton (interpreted on CPU, native on GPU) and
the PyTorch path against the autograd reference, forward and every gradient; the mask is the
same on both backends and never stored; keep rate; torch.compile; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tachyon.kernels.dropout import bias_dropout_add, bias_dropout_add_layer_norm, reference
from tachyon.kernels.random import dropout_keep_mask
from tests.utils import assert_close, assert_close_to_reference

CPU_CASES = [("cpu", torch.float32), ("cpu", torch.float16)]
GPU_CASES = [pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.float16, torch.bfloat16)]
SHAPES = [(5, 123), (3, 1000), (2, 3, 64)]
SEED = 1234


def _leaves(shape, dtype, device, with_bias=True, with_residual=True, with_norm=False, with_ln_bias=True):
    n = shape[-1]
    x = torch.randn(shape, device=device).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(n, device=device)).to(dtype).requires_grad_() if with_bias else None
    r = torch.randn(shape, device=device).to(dtype).requires_grad_() if with_residual else None
    if not with_norm:
        return [x, b, r]
    # norm weights away from zero, as trained ones are (the invertible backward divides by them)
    w = torch.empty(n, device=device).uniform_(0.5, 1.5).to(dtype).requires_grad_()
    lb = (0.1 * torch.randn(n, device=device)).to(dtype).requires_grad_() if with_ln_bias else None
    return [x, b, r, w, lb]


def _compare(fn, ref, leaves, shape, device, dtype, names, invertible=False):
    """fn/ref return a tuple of outputs; compares every output and the gradient of every leaf
    against ref on fp32 leaves: fp32 by the table, fp16/bf16 by the 2x-of-PyTorch rule.
    ``invertible``: fn's norm backward recomputes the normalized input from its rounded output y,
    xhat = (y - ln_b) / w, which carries up to (|y| + |ln_b|) * u / |w| more error per element
    (u: the dtype's unit roundoff) than the reference's xhat from z; dweight = sum over rows of
    dy * xhat gets that bound, summed over its column, as inherent error."""
    grads_out = None

    def run(f, ls):
        nonlocal grads_out
        outs = f(*ls)
        if grads_out is None:
            grads_out = [torch.randn(shape, device=device) for _ in outs]
        loss = sum((o.float() * g).sum() for o, g in zip(outs, grads_out))
        return [*outs, *torch.autograd.grad(loss, [t for t in ls if t is not None])]

    leaves32 = [t.detach().float().requires_grad_() if t is not None else None for t in leaves]
    got, lowp, oracle = run(fn, leaves), run(ref, leaves), run(ref, leaves32)
    n_out = len(got) - sum(t is not None for t in leaves)
    names = names[:n_out] + [n for n, t in zip(names[n_out:], leaves) if t is not None]
    inherent = {}
    if invertible and dtype != torch.float32:
        y, w, lnb = got[0].detach().double(), leaves[3].detach().double(), leaves[4]
        shift = y.abs() + (lnb.detach().double().abs() if lnb is not None else 0.0)
        u = torch.finfo(dtype).eps / 2
        inherent["dweight"] = ((grads_out[0].double().abs() * shift / w.abs()).sum(0).max() * u).item()
    for name, g, lo, o in zip(names, got, lowp, oracle):
        assert g.dtype == lo.dtype, f"{name}: dtype {g.dtype}, the reference returns {lo.dtype}"
        if dtype == torch.float32:
            assert_close(g, o, name=name)
        else:
            assert_close_to_reference(g, lo, o, name=name, inherent=inherent.get(name, 0.0))


BDA_NAMES = ["out", "dx", "dbias", "dresidual"]
LN_NAMES = ["y", "z", "dx", "dbias", "dresidual", "dweight", "dln_bias"]


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (False, True), (True, False)],
                         ids=["bias+res", "res", "bias"])
def test_bias_dropout_add_triton_matches_reference(device, dtype, shape, p, with_bias, with_residual):
    leaves = _leaves(shape, dtype, device, with_bias, with_residual)
    _compare(lambda x, b, r: (bias_dropout_add(x, b, r, p, SEED, backend="triton"),),
             lambda x, b, r: (reference.bias_dropout_add(x, b, r, p, SEED),), leaves, shape, device, dtype, BDA_NAMES)


@pytest.mark.parametrize("shape", [(70, 123), (9, 1100)], ids=str)
def test_bias_dropout_add_triton_several_row_and_column_blocks(shape):
    """The backward splits rows over several programs (bias-gradient partials summed) and columns
    over several blocks."""
    leaves = _leaves(shape, torch.float32, "cpu")
    _compare(lambda x, b, r: (bias_dropout_add(x, b, r, 0.2, SEED, backend="triton"),),
             lambda x, b, r: (reference.bias_dropout_add(x, b, r, 0.2, SEED),), leaves, shape, "cpu", torch.float32,
             BDA_NAMES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_dropout_add_torch_backend_matches_autograd(dtype, shape, p):
    leaves = _leaves(shape, dtype, "cpu")
    _compare(lambda x, b, r: (bias_dropout_add(x, b, r, p, SEED, backend="torch"),),
             lambda x, b, r: (reference.bias_dropout_add(x, b, r, p, SEED),), leaves, shape, "cpu", dtype, BDA_NAMES)


def _ln_case(backend, shape, dtype, device, p, rms, invertible, with_bias=True, with_residual=True, with_ln_bias=True):
    leaves = _leaves(shape, dtype, device, with_bias, with_residual, True, with_ln_bias)
    eps = 1e-5
    _compare(
        lambda x, b, r, w, lb: bias_dropout_add_layer_norm(x, b, r, w, lb, eps, p, SEED, rms=rms,
                                                           invertible=invertible, backend=backend),
        lambda x, b, r, w, lb: reference.bias_dropout_add_layer_norm(x, b, r, w, lb, eps, p, SEED, rms=rms),
        leaves, shape, device, dtype, LN_NAMES, invertible=invertible,
    )


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_bias_dropout_add_layer_norm_triton_matches_reference(device, dtype, shape, p, rms):
    _ln_case("triton", shape, dtype, device, p, rms, False)


@pytest.mark.parametrize("device,dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("invertible", [False, True], ids=["saves_z", "invertible"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("missing", ["bias", "residual", "ln_bias"])
def test_bias_dropout_add_layer_norm_optional_inputs_and_invertible(device, dtype, backend, invertible, rms, missing):
    _ln_case(backend, (5, 123), dtype, device, 0.1, rms, invertible, with_bias=missing != "bias",
             with_residual=missing != "residual", with_ln_bias=missing != "ln_bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_bias_dropout_add_layer_norm_torch_backend_matches_autograd(dtype, shape, rms):
    _ln_case("torch", shape, dtype, "cpu", 0.2, rms, False)


def test_without_dropout_it_is_the_torch_sequence_it_replaces():
    x, b, r = torch.randn(6, 48), torch.randn(48), torch.randn(6, 48)
    w, lb = torch.rand(48) + 0.5, torch.randn(48)
    want = r + F.dropout(x + b, p=0.1, training=False)
    assert_close(bias_dropout_add(x, b, r, 0.1, None, training=False, backend="triton"), want, name="out (eval)")
    assert_close(bias_dropout_add(x, b, r, 0.0, None, backend="triton"), want, name="out (p=0)")
    for backend in ("triton", "torch"):
        y, z = bias_dropout_add_layer_norm(x, b, r, w, lb, 1e-5, 0.1, None, training=False, backend=backend)
        assert_close(z, want, name="z")
        assert_close(y, F.layer_norm(want, (48,), w, lb, 1e-5), name="y (LayerNorm)")
        y, _ = bias_dropout_add_layer_norm(x, b, r, w, None, 1e-6, 0.0, None, rms=True, backend=backend)
        assert_close(y, F.rms_norm(want, (48,), w, 1e-6), name="y (RMSNorm)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_and_torch_drop_exactly_the_same_elements(device, p):
    x = torch.ones(7, 300, device=device)
    scale = 1.0 / (1.0 - p)
    outs = [bias_dropout_add(x, None, None, p, SEED, backend=be) for be in ("triton", "torch")]
    keep = dropout_keep_mask(SEED, (7, 300), p, device=device)
    for out in outs:
        assert torch.equal(out != 0, keep), f"{int(((out != 0) != keep).sum())} elements disagree with the Philox mask"
        assert torch.equal(out[keep], torch.full_like(out[keep], scale))
    w = torch.ones(300, device=device)
    y_tri, z_tri = bias_dropout_add_layer_norm(x, None, None, w, None, 1e-5, p, SEED, backend="triton")
    assert torch.equal(z_tri != 0, keep), "the fused LayerNorm kernel drops other elements"
    # the backward regenerates the same mask: dx is zero exactly where the forward dropped
    for backend in ("triton", "torch"):
        xx = x.clone().requires_grad_()
        bias_dropout_add(xx, None, None, p, SEED, backend=backend).sum().backward()
        assert torch.equal(xx.grad != 0, keep), f"{backend}: the backward mask differs from the forward's"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_same_seed_same_mask_other_seed_other_mask(backend):
    x = torch.randn(4, 256)
    a = bias_dropout_add(x, None, None, 0.3, 11, backend=backend)
    assert torch.equal(a, bias_dropout_add(x, None, None, 0.3, 11, backend=backend))
    assert not torch.equal(a, bias_dropout_add(x, None, None, 0.3, 12, backend=backend))


@pytest.mark.parametrize("backend,shape", [("torch", (64, 500)), ("triton", (32, 512))])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_statistical_bounds(backend, shape, p):
    out = bias_dropout_add(torch.ones(shape), None, None, p, SEED + 1, backend=backend)
    n = out.numel()
    rate = (out != 0).float().mean().item()
    sd = ((1 - p) * p / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sd, f"keep rate {rate:.4f}, expected {1 - p} +- {5 * sd:.4f} (5 sd)"
    # E[out] = x: the 1/(1-p) scaling keeps the mean
    assert abs(out.mean().item() - 1.0) < 5 * sd / (1 - p)


def test_p_one_drops_everything():
    x, r = torch.randn(3, 40), torch.randn(3, 40)
    for backend in ("triton", "torch"):
        assert torch.equal(bias_dropout_add(x, None, r, 1.0, SEED, backend=backend), r)


def _saved(fn):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bias_dropout_add_saves_nothing_of_the_input_size(backend):
    x = torch.randn(4, 64, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    r = torch.randn(4, 64, requires_grad=True)
    saved, _ = _saved(lambda: bias_dropout_add(x, b, r, 0.2, SEED, backend=backend))
    big = [tuple(t.shape) for t in saved if t.numel() >= x.numel()]
    assert not big, f"tensors of x's size saved for backward: {big}"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_invertible_saves_y_instead_of_z(backend):
    x = torch.randn(4, 64, requires_grad=True)
    r = torch.randn(4, 64, requires_grad=True)
    w = (torch.rand(64) + 0.5).requires_grad_()
    for invertible in (False, True):
        saved, (y, z) = _saved(lambda: bias_dropout_add_layer_norm(
            x, None, r, w, None, 1e-5, 0.1, SEED, invertible=invertible, backend=backend))
        ptrs = {t.untyped_storage().data_ptr() for t in saved}
        assert (z.untyped_storage().data_ptr() in ptrs) != invertible, f"invertible={invertible}: z saved?"
        assert (y.untyped_storage().data_ptr() in ptrs) == invertible, f"invertible={invertible}: y saved?"
        assert sum(t.numel() >= x.numel() for t in saved) == 1, "exactly one [M, N] tensor is saved"


def test_torch_compile_traces_the_ops():
    """The custom ops trace with fullgraph (through their fake implementations); the Triton
    backend so that the compiled graph runs the kernels (the torch backend is the same op)."""
    backend = "triton"
    x = torch.randn(6, 40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    r = torch.randn(6, 40, requires_grad=True)
    w = (torch.rand(40) + 0.5).requires_grad_()

    def f(x, b, r, w):
        h = bias_dropout_add(x, b, r, 0.1, 3, backend=backend)
        y, z = bias_dropout_add_layer_norm(h, b, r, w, b, 1e-5, 0.2, 4, backend=backend)
        return (y * z).sum()

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, b, r, w)
    grads = torch.autograd.grad(got, [x, b, r, w])
    want = f(x, b, r, w)
    for name, a, e in zip(["loss", "dx", "db", "dr", "dw"], [got, *grads],
                          [want, *torch.autograd.grad(want, [x, b, r, w])]):
        assert_close(a, e, name=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tensor_seed_is_bit_identical_to_the_int_seed(backend):
    """The same seed value as an int or as a 0-dim int64 tensor: the same masks, outputs and
    gradients, bit for bit, both ops (the tensor seed is loaded by the kernels, saved for backward)."""
    seed = 2**62 + 977
    leaves = _leaves((7, 45), torch.float32, "cpu", with_norm=True)
    results = []
    for s in (seed, torch.tensor(seed)):
        x, b, r, w, lb = leaves
        h = bias_dropout_add(x, b, r, 0.3, s, backend=backend)
        y, z = bias_dropout_add_layer_norm(h, b, r, w, lb, 1e-5, 0.2, s, backend=backend)
        y2, _ = bias_dropout_add_layer_norm(x, b, None, w, lb, 1e-5, 0.4, s, invertible=True, rms=True, backend=backend)
        outs = [h, y, z, y2]
        grads = torch.autograd.grad(sum((o * o).sum() for o in outs), leaves)
        results.append(outs + list(grads))
    for name, a, e in zip(["h", "y", "z", "y2", "dx", "db", "dr", "dw", "dlnb"], *results):
        assert torch.equal(a, e), f"{backend}: {name} differs between int and tensor seed"
    keep = dropout_keep_mask(seed, (7, 45), 0.3)
    x, b, r = leaves[:3]
    assert_close(results[0][0], torch.where(keep, (x + b) / 0.7, 0.0) + r, name="out with the documented mask")


def test_compiled_ops_take_a_new_tensor_seed_without_recompiling():
    """A tensor seed is a graph input: new seed values reuse the compiled graph (an int seed
    would be a constant in it) and give the eager result with that seed."""
    x = torch.randn(6, 40, requires_grad=True)
    b, w = torch.randn(40, requires_grad=True), (torch.rand(40) + 0.5).requires_grad_()

    def f(x, b, w, seed):
        h = bias_dropout_add(x, b, None, 0.3, seed, backend="torch")
        y, _ = bias_dropout_add_layer_norm(h, b, x, w, None, 1e-5, 0.2, seed, backend="torch")
        return y

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(x, b, w, torch.tensor(1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (2, 2**40 + 1, 2**63 - 1):
            got = compiled(x, b, w, torch.tensor(seed))
            want = f(x, b, w, seed)
            assert torch.equal(got, want), f"seed {seed}: compiled != eager"
            for name, g, e in zip(["dx", "db", "dw"], torch.autograd.grad(got.sum(), [x, b, w]),
                                  torch.autograd.grad(want.sum(), [x, b, w])):
                assert torch.equal(g, e), f"seed {seed}: {name} compiled != eager"


def test_bad_inputs_name_the_argument_and_what_is_allowed():
    x, w = torch.randn(3, 16), torch.ones(16)
    with pytest.raises(ValueError, match=r"bias_dropout_add: p is the dropout probability and must be a number in \[0, 1\]; got 1.5"):
        bias_dropout_add(x, None, None, 1.5, SEED)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\) or a 0-dim torch.int64 tensor on cpu "
                                         r"when dropout is active .*got None"):
        bias_dropout_add(x, None, None, 0.1, None)
    with pytest.raises(ValueError, match=r"bias_dropout_add: seed must be .* 0-dim torch.int64 tensor on cpu .*got a "
                                         r"tensor of dtype torch.int32, shape \(\) on cpu"):
        bias_dropout_add(x, None, None, 0.1, torch.tensor(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"bias_dropout_add_layer_norm: seed must be .*got a tensor of dtype "
                                         r"torch.int64, shape \(2,\) on cpu"):
        bias_dropout_add_layer_norm(x, None, None, w, None, 1e-5, 0.1, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"seed must be an int .*got -1"):
        bias_dropout_add_layer_norm(x, None, None, w, None, 1e-5, 0.1, -1)
    with pytest.raises(ValueError, match=r"bias_dropout_add: bias has shape \(8,\); expected \(16,\)"):
        bias_dropout_add(x, torch.randn(8), None, 0.0, None)
    with pytest.raises(ValueError, match=r"residual has shape \(3, 8\); expected \(3, 16\)"):
        bias_dropout_add(x, None, torch.randn(3, 8), 0.0, None)
    with pytest.raises(ValueError, match=r"residual has dtype torch.float16 but x has torch.float32"):
        bias_dropout_add(x, None, x.half(), 0.0, None)
    with pytest.raises(ValueError, match=r"x has dtype torch.float64.*allowed: float32, float16, bfloat16"):
        bias_dropout_add(x.double(), None, None, 0.0, None)
    with pytest.raises(ValueError, match=r"bias_dropout_add_layer_norm: weight has shape \(15,\); expected \(16,\)"):
        bias_dropout_add_layer_norm(x, None, None, torch.ones(15), None, 1e-5, 0.0, None)
    with pytest.raises(ValueError, match=r"ln_bias has shape \(4,\); expected \(16,\)"):
        bias_dropout_add_layer_norm(x, None, None, w, torch.ones(4), 1e-5, 0.0, None)
    with pytest.raises(ValueError, match=r"eps must be a number >= 0; got -1"):
        bias_dropout_add_layer_norm(x, None, None, w, None, -1, 0.0, None)
    with pytest.raises(ValueError, match=r"training must be True or False; got 1"):
        bias_dropout_add(x, None, None, 0.1, SEED, training=1)


_AOT_SCRIPT = """
from tests.utils.aot import compile_sm90
from tachyon.kernels.dropout import triton as tri

fp32 = {"MEAN", "RSTD", "DW_PART", "DLNB_PART", "DB_PART"}
scalars = {"seed": "i64", "p": "fp32", "scale": "fp32", "eps": "fp32"}


def compile_(kernel, consts, num_warps):
    names = kernel.arg_names
    types = {n: "*i64" if n == "SEED_PTR" else ("*fp32" if n in fp32 else "*bf16")
             for n in names if n.isupper() and n not in ("M", "N")}
    types.update({n: t for n, t in scalars.items() if n in names})
    types = {n: t for n, t in types.items() if n not in consts}
    compile_sm90(kernel, types, consts, num_warps=num_warps, aligned_ints=[n for n in names if n.startswith("stride")] + ["N"])


# bias_dropout_add at N = 4096: 4 x 1024 tiles, 8 warps (the launcher's _tiles); int and tensor seeds
compile_(tri._bda_fwd_kernel, dict(HAS_BIAS=True, HAS_RES=True, DROPOUT=True, SEED_FROM_PTR=False, BLOCK_M=4,
                                   BLOCK_N=1024), 8)
compile_(tri._bda_bwd_kernel, dict(HAS_BIAS=True, DROPOUT=True, SEED_FROM_PTR=True, BLOCK_M=4, BLOCK_N=1024), 8)
# the fused LayerNorm/RMSNorm forms: one row per program, BLOCK_N = N, num_warps = BLOCK_N // 256
flags = dict(HAS_BIAS=True, HAS_RES=True, HAS_LNB=True, DROPOUT=True)
compile_(tri._bda_norm_fwd_kernel, dict(flags, IS_RMS=False, SEED_FROM_PTR=True, BLOCK_N=4096), 16)
compile_(tri._bda_norm_fwd_kernel, dict(flags, IS_RMS=True, SEED_FROM_PTR=False, BLOCK_N=2048), 8)
flags = dict(HAS_LNB=True, HAS_DZ_OUT=True, STORE_DRES=True, HAS_BIAS=True, DROPOUT=True)
compile_(tri._bda_norm_bwd_kernel, dict(flags, IS_RMS=False, FROM_OUTPUT=False, SEED_FROM_PTR=True, BLOCK_N=4096), 16)
compile_(tri._bda_norm_bwd_kernel, dict(flags, IS_RMS=True, FROM_OUTPUT=True, SEED_FROM_PTR=False, BLOCK_N=2048), 8)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never runs Triton's compiler: build all four kernels (TTIR -> PTX -> cubin
    with the bundled ptxas) for compute capability 9.0 in bf16, every flag on, both norms, a
    64-bit int seed and a seed loaded from a tensor."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=6)
