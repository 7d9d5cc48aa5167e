"""The multi-tensor Adam/AdamW Triton kernel: one launch updates up to 16 tensors in place.

Design: everything a launch needs besides the tensors themselves is a kernel argument. Up to
MAX_TENSORS tensors go to one launch: their param, grad, exp_avg and exp_avg_sq pointers as four
tuples, their sizes and first programs as tuples of ints, and their step scalars (step_size = lr /
bc1, sqrt(bc2): step counts may differ per tensor) as tuples of floats. Program ``pid`` belongs to
the tensor whose program range holds it (the kernel tests the N ranges, unrolled) and updates
elements ``[(pid - first) * CHUNK, ... + CHUNK)`` in BLOCK-wide slices. So a step reads param,
grad and the two moments and writes param and the moments, and nothing else: no pointer table in
memory, and no host-to-device copy of one each step (which would also wait for the GPU's queue).
A flat ZeRO partition is one tensor, one launch; a list of ordinary parameters is a launch per
MAX_TENSORS tensors of one (param dtype, grad dtype) pair. Full chunks run unmasked (their loads
and stores vectorize where Triton's argument specialization knows a pointer is 16-byte aligned);
only each tensor's last chunk is masked. Every tensor must be contiguous.

Per element (fp32 math; the op order of torch.optim.AdamW, so fp32 results match it to rounding):
    g = grad + l2_wd * p            (classic Adam)   |   p = p * decay   (AdamW, decay = 1 - lr*wd)
    m = m + (1 - beta1) * (g - m);  v = v * beta2 + (1 - beta2) * g * g
    p = p - step_size * (m / (sqrt(v) / sqrt(bc2) + eps))      (IEEE-rounded sqrt and divisions)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.ints import cdiv
from tachyon.kernels.launch import fast_launch
from torch import Tensor

BLOCK = 1024
CHUNK = 4096  # elements per program: a 350M-element partition is ~85k programs
MAX_TENSORS = 16  # tensors per launch: each adds a branch to the compiled kernel


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _adam_slice(
    p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, step_size, bc2_sqrt,
    decay, l2_wd, one_minus_beta1, beta2, one_minus_beta2, eps,
    ADAM_W_MODE: tl.constexpr, MASKED: tl.constexpr,
):
    p = _load(p_ptr + offs, mask, MASKED).to(tl.float32)
    g = _load(g_ptr + offs, mask, MASKED).to(tl.float32)
    m = _load(m_ptr + offs, mask, MASKED)
    v = _load(v_ptr + offs, mask, MASKED)
    if ADAM_W_MODE:
        p = p * decay
    else:
        g = g + l2_wd * p
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    _store(m_ptr + offs, m, mask, MASKED)
    _store(v_ptr + offs, v, mask, MASKED)
    _store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask, MASKED)


@triton.jit
def _adam_chunk(
    p_ptr, g_ptr, m_ptr, v_ptr, start, numel, step_size, bc2_sqrt,
    decay, l2_wd, one_minus_beta1, beta2, one_minus_beta2, eps,
    ADAM_W_MODE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Elements [start, start + CHUNK) of one tensor of ``numel``: a full chunk without masks
    (loads and stores vectorize), the tail with them."""
    if start + CHUNK <= numel:
        for i in range(CHUNK // BLOCK):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _adam_slice(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, step_size, bc2_sqrt, decay, l2_wd,
                        one_minus_beta1, beta2, one_minus_beta2, eps, ADAM_W_MODE, False)
    else:
        for i in range(CHUNK // BLOCK):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _adam_slice(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < numel, step_size, bc2_sqrt, decay, l2_wd,
                        one_minus_beta1, beta2, one_minus_beta2, eps, ADAM_W_MODE, True)


@fast_launch
@triton.jit
def _adam_kernel(
    P, G, M, V, NUMELS, FIRSTS, STEP_SIZES, BC2_SQRTS,
    decay, l2_wd, one_minus_beta1, beta2, one_minus_beta2, eps,
    N: tl.constexpr, ADAM_W_MODE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Up to MAX_TENSORS tensors: P, G, M, V are tuples of N pointers, NUMELS and FIRSTS (each
    tensor's first program) tuples of N ints, STEP_SIZES and BC2_SQRTS of N floats, all kernel
    arguments. Program pid updates elements [(pid - FIRSTS[i]) * CHUNK, + CHUNK) of the tensor
    whose programs it falls in: nothing but the tensors themselves is read from memory."""
    pid = tl.program_id(0)
    for i in tl.static_range(N):
        first = FIRSTS[i]
        numel = NUMELS[i]
        if (pid >= first) & (pid < first + tl.cdiv(numel, CHUNK)):
            start = (pid - first).to(tl.int64) * CHUNK
            _adam_chunk(P[i], G[i], M[i], V[i], start, numel, STEP_SIZES[i], BC2_SQRTS[i], decay, l2_wd,
                        one_minus_beta1, beta2, one_minus_beta2, eps, ADAM_W_MODE, CHUNK, BLOCK)


def adam_step(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    scalars: list[tuple[float, float]], lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, adam_w_mode: bool,
) -> None:
    """Launch the kernel over tensors that share a device, a param dtype and a grad dtype: one
    launch per MAX_TENSORS of them.

    scalars: per tensor (step_size, sqrt(bc2)) from reference.step_scalars. Inputs are checked by
    the op (contiguous, matching shapes, fp32 states).
    """
    hyper = (1.0 - lr * weight_decay, weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps)
    for lo in range(0, len(params), MAX_TENSORS):
        group = [i for i in range(lo, min(lo + MAX_TENSORS, len(params))) if params[i].numel()]
        if not group:
            continue
        firsts, programs = [], 0
        for i in group:
            firsts.append(programs)
            programs += cdiv(params[i].numel(), CHUNK)
        _adam_kernel[(programs,)](
            tuple(params[i] for i in group), tuple(grads[i] for i in group), tuple(exp_avgs[i] for i in group),
            tuple(exp_avg_sqs[i] for i in group), tuple(params[i].numel() for i in group), tuple(firsts),
            tuple(float(scalars[i][0]) for i in group), tuple(float(scalars[i][1]) for i in group), *hyper,
            N=len(group), ADAM_W_MODE=adam_w_mode, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4,
        )
