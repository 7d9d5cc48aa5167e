"""The multi-tensor Adam kernel: Triton (interpreted on CPU, native on GPU) against the PyTorch
reference on lists of odd-shaped tensors, and the op's input checks."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.adam import multi_tensor_adam, reference
from tests.utils import assert_close

# bf16 params are GPU-only: Triton's interpreter rounds fp32 -> bf16 toward zero (the GPU rounds
# to nearest), so a bf16 store under the interpreter is off by an ulp against torch's cast.
CPU_CASES = [("cpu", torch.float32, torch.float32), ("cpu", torch.float32, torch.float16)]
GPU_CASES = [
    pytest.param("cuda", pdt, gdt, marks=pytest.mark.gpu)
    for pdt, gdt in ((torch.float32, torch.float32), (torch.float32, torch.float16),
                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16))
]
# 5000 elements span two kernel programs (CHUNK = 4096); the others are odd and tiny
SHAPES = [(5000,), (7, 3), (1,), (3, 5, 7)]


def _tensors(device, p_dtype, g_dtype, shapes=SHAPES):
    params = [torch.randn(s, device=device).to(p_dtype) for s in shapes]
    exp_avgs = [0.1 * torch.randn(s, device=device) for s in shapes]
    exp_avg_sqs = [0.01 * torch.rand(s, device=device) for s in shapes]
    return params, exp_avgs, exp_avg_sqs


def _clone(tensors):
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("device,p_dtype,g_dtype", CPU_CASES + GPU_CASES)
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
def test_triton_matches_reference(device, p_dtype, g_dtype, adam_w_mode, bias_correction):
    params, exp_avgs, exp_avg_sqs = _tensors(device, p_dtype, g_dtype)
    ref = (_clone(params), _clone(exp_avgs), _clone(exp_avg_sqs))
    steps = [1, 2, 7, 1]  # per tensor: a param that skipped steps has its own count
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adam_w_mode=adam_w_mode,
              bias_correction=bias_correction)
    for _ in range(2):
        grads = [torch.randn(p.shape, device=device).to(g_dtype) for p in params]
        multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, steps, backend="triton", **kw)
        reference.adam_step(ref[0], grads, ref[1], ref[2], steps, 1e-2, 0.9, 0.99, 1e-8, 0.1,
                            adam_w_mode, bias_correction)
        steps = [s + 1 for s in steps]
    for i in range(len(SHAPES)):
        assert params[i].dtype == p_dtype
        assert_close(params[i], ref[0][i], name=f"params[{i}]")
        assert_close(exp_avgs[i], ref[1][i], name=f"exp_avgs[{i}]")
        assert_close(exp_avg_sqs[i], ref[2][i], name=f"exp_avg_sqs[{i}]")


def test_reference_matches_hand_formula():
    """One step of the reference against the textbook AdamW formula, written out in fp64."""
    p = torch.randn(17, dtype=torch.float64)
    g = torch.randn(17, dtype=torch.float64)
    m = 0.1 * torch.randn(17, dtype=torch.float64)
    v = 0.01 * torch.rand(17, dtype=torch.float64)
    lr, b1, b2, eps, wd, t = 1e-2, 0.9, 0.99, 1e-8, 0.1, 3
    p32, m32, v32 = p.float(), m.float(), v.float()
    reference.adam_step([p32], [g.float()], [m32], [v32], [t], lr, b1, b2, eps, wd, True, True)
    m_new = b1 * m + (1 - b1) * g
    v_new = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m_new / (1 - b1**t), v_new / (1 - b2**t)
    p_new = p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    assert_close(m32, m_new.float(), name="exp_avg")
    assert_close(v32, v_new.float(), name="exp_avg_sq")
    assert_close(p32, p_new.float(), name="param")


def test_flat_partition_equals_separate_tensors():
    """One flat tensor (one launch) and the same values as separate tensors give the same update."""
    params, exp_avgs, exp_avg_sqs = _tensors("cpu", torch.float32, torch.float32)
    grads = [torch.randn(p.shape) for p in params]
    flat = [torch.cat([t.reshape(-1) for t in ts]) for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, [3] * 4, lr=1e-2, weight_decay=0.1, backend="triton")
    multi_tensor_adam([flat[0]], [flat[1]], [flat[2]], [flat[3]], [3], lr=1e-2, weight_decay=0.1, backend="triton")
    assert torch.equal(flat[0], torch.cat([p.reshape(-1) for p in params]))
    assert torch.equal(flat[3], torch.cat([v.reshape(-1) for v in exp_avg_sqs]))


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.float16])
def test_flat_partition_step_moves_exactly_its_minimum(g_dtype):
    """One flat tensor (a ZeRO partition): one launch that reads param, grad and both moments and
    writes param and both moments, and nothing else (no pointer table, no program map, no step
    scalars in memory), counted. The same tensors as a list of two move the same bytes."""
    from tachyon.profiling import TrafficCounter

    n = 3 * 4096 + 77  # three full chunks and a masked one
    p, m, v = torch.randn(n), 0.1 * torch.randn(n), 0.01 * torch.rand(n)
    g = torch.randn(n).to(g_dtype)
    with TrafficCounter() as counter:
        multi_tensor_adam([p], [g], [m], [v], [4], lr=1e-2, weight_decay=0.1, backend="triton")
    f32, grad = 4 * n, g.element_size() * n
    assert counter.total.launches == 1, counter.table()
    assert counter.total.read == 3 * f32 + grad, counter.table()
    assert counter.total.written == 3 * f32, counter.table()
    halves = [t.split([n // 2, n - n // 2]) for t in (p, g, m, v)]
    with TrafficCounter() as listed:
        multi_tensor_adam(*map(list, halves), [4, 4], lr=1e-2, weight_decay=0.1, backend="triton")
    assert (listed.total.read, listed.total.written, listed.total.launches) == (
        counter.total.read, counter.total.written, 1), "a list moves what one flat tensor moves"


def test_more_tensors_than_one_launch_takes_match_reference():
    """More than MAX_TENSORS tensors (two launches), sizes from 1 to several chunks, different step
    counts: each tensor gets its own step scalars from the kernel arguments."""
    from tachyon.kernels.adam import triton as tri

    g = torch.Generator().manual_seed(7)
    numels = [1, 4096, 5000, 37, 8193] * 4
    assert len(numels) > tri.MAX_TENSORS
    params = [torch.randn(n, generator=g) for n in numels]
    grads = [torch.randn(n, generator=g) for n in numels]
    ms = [0.1 * torch.randn(n, generator=g) for n in numels]
    vs = [0.01 * torch.rand(n, generator=g) for n in numels]
    steps = [1 + i % 3 for i in range(len(numels))]
    ref = [[t.clone() for t in ts] for ts in (params, ms, vs)]
    multi_tensor_adam(params, grads, ms, vs, steps, lr=1e-2, weight_decay=0.1, backend="triton")
    reference.adam_step(ref[0], grads, ref[1], ref[2], steps, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, True)
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), (params, ms, vs), ref):
        for i, (a, e) in enumerate(zip(got, want)):
            assert_close(a, e, name=f"{name}[{i}]")


def test_unaligned_views_match_reference():
    """Views that start mid-allocation (not 16-byte aligned) take the kernel's unhinted path."""
    bases = [torch.randn(4101) for _ in range(4)]
    p, g, m, v = (b[1:] for b in bases)
    m.mul_(0.1)
    v.abs_().mul_(0.01)
    ref = [t.clone() for t in (p, m, v)]
    multi_tensor_adam([p], [g], [m], [v], [2], lr=1e-2, weight_decay=0.1, backend="triton")
    reference.adam_step([ref[0]], [g], [ref[1]], [ref[2]], [2], 1e-2, 0.9, 0.999, 1e-8, 0.1, True, True)
    for name, a, e in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), ref):
        assert_close(a, e, name=name)


def test_empty_list_and_empty_tensor_are_no_ops():
    multi_tensor_adam([], [], [], [], [], backend="torch")
    p = torch.zeros(0)
    multi_tensor_adam([p], [torch.zeros(0)], [torch.zeros(0)], [torch.zeros(0)], [1], backend="triton")


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(grads=[]), "grads has 0 entries but params has 1"),
    (lambda a: a.update(exp_avgs=[a["exp_avgs"][0].double()]), r"exp_avgs\[0\] has dtype"),
    (lambda a: a.update(grads=[torch.zeros(4)]), r"grads\[0\] has shape"),
    (lambda a: a.update(params=[torch.zeros(3, dtype=torch.int32)]), r"params\[0\] has dtype"),
    (lambda a: a.update(steps=[0]), r"steps\[0\] must be an int >= 1"),
    (lambda a: a.update(lr=-1.0), "lr must be"),
    (lambda a: a.update(betas=(0.9, 1.0)), r"betas\[1\]"),
    (lambda a: a.update(eps=-1e-8), "eps must be"),
    (lambda a: a.update(weight_decay=-0.1), "weight_decay must be"),
    (lambda a: a.update(backend="cuda"), "backend='cuda' is not a tachyon backend"),
])
def test_bad_input_raises(change, match):
    args = dict(params=[torch.zeros(3)], grads=[torch.zeros(3)], exp_avgs=[torch.zeros(3)],
                exp_avg_sqs=[torch.zeros(3)], steps=[1], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, backend="torch")
    change(args)
    with pytest.raises(ValueError, match=match):
        multi_tensor_adam(**args)


def test_custom_op_registration():
    """Schema, fake (meta) implementation and aot dispatch of tachyon::adam_step, for torch.compile."""
    from tachyon.kernels.adam.op import _adam_step

    ps = [torch.randn(5), torch.randn(3, 2)]
    args = (ps, [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
            [torch.zeros_like(p) for p in ps], [1, 2], 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, "torch")
    torch.library.opcheck(_adam_step, args)


def test_triton_rejects_non_contiguous():
    p = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match=r"params\[0\] is not contiguous"):
        multi_tensor_adam([p], [torch.zeros(6, 4)], [torch.zeros(6, 4)], [torch.zeros(6, 4)], [1], backend="triton")


_AOT_SCRIPT = """
from tests.utils.aot import compile_sm90
from tachyon.kernels.adam import triton as tri

scalars = ("decay", "l2_wd", "one_minus_beta1", "beta2", "one_minus_beta2", "eps")
for param, grad, adam_w, n in (("*bf16", "*bf16", True, tri.MAX_TENSORS), ("*fp32", "*bf16", False, 3),
                               ("*fp32", "*fp32", True, 1)):
    types = {"P": (param,) * n, "G": (grad,) * n, "M": ("*fp32",) * n, "V": ("*fp32",) * n, "NUMELS": ("i32",) * n,
             "FIRSTS": ("i32",) * n, "STEP_SIZES": ("fp32",) * n, "BC2_SQRTS": ("fp32",) * n}
    types.update({name: "fp32" for name in scalars})
    compile_sm90(tri._adam_kernel, types, dict(N=n, ADAM_W_MODE=adam_w, CHUNK=tri.CHUNK, BLOCK=tri.BLOCK), num_warps=4)
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter never runs Triton's compiler: build the multi-tensor kernel (TTIR -> PTX ->
    cubin with the bundled ptxas) for compute capability 9.0, its pointers, sizes and step scalars
    as tuple arguments: bf16 and fp32 params with bf16/fp32 grads, AdamW and L2 Adam, 16, 3 and 1
    tensors per launch."""
    from tests.utils.aot import compile_in_subprocess

    compile_in_subprocess(_AOT_SCRIPT, expected=3)
