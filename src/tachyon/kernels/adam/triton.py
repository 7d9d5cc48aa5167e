"""The multi-tensor Adam/AdamW Triton kernel: one launch updates a whole list of tensors in place.

Design: the launcher writes a small table per call, one row per tensor,

    table   int64 [n_tensors, 6]: (param ptr, grad ptr, exp_avg ptr, exp_avg_sq ptr, numel, first_program)
    scalars fp32  [n_tensors, 2]: (step_size = lr / bc1, sqrt(bc2))   (per tensor: step counts may differ)

and a cached map ``program -> tensor`` (int32 [n_programs]). Program ``pid`` handles elements
``[(pid - first_program) * CHUNK, ... + CHUNK)`` of its tensor in BLOCK-wide slices. A flat ZeRO
partition is one tensor, so one launch, and it needs no table: ``_adam_flat_kernel`` takes its
four pointers and two step scalars as kernel arguments (it reads param, grad and the moments and
nothing else); a list of ordinary parameters is also one launch per (param dtype, grad dtype)
pair. Pointers are loaded from the table and cast to the element type of a "witness" tensor
argument of the same dtype. Every tensor must be contiguous. Pointers
loaded from memory carry no alignment facts, so the launcher checks that all are 16-byte aligned
and then says so (tl.multiple_of); full chunks run unmasked, so their loads and stores vectorize
(128-bit), and only each tensor's last chunk is masked.

Per element (fp32 math; the op order of torch.optim.AdamW, so fp32 results match it to rounding):
    g = grad + l2_wd * p            (classic Adam)   |   p = p * decay   (AdamW, decay = 1 - lr*wd)
    m = m + (1 - beta1) * (g - m);  v = v * beta2 + (1 - beta2) * g * g
    p = p - step_size * (m / (sqrt(v) / sqrt(bc2) + eps))      (IEEE-rounded sqrt and divisions)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
CHUNK = 4096  # elements per program: a 350M-element partition is ~85k programs
_MAX_CACHED_MAPS = 16
_program_maps: dict[tuple, Tensor] = {}


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


@triton.jit
def _adam_kernel(
    table, scalars, program_tensor, p_witness, g_witness,
    decay, l2_wd, one_minus_beta1, beta2, one_minus_beta2, eps,
    ADAM_W_MODE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(program_tensor + pid).to(tl.int64)
    row = table + t * 6
    p_ptr = tl.load(row).to(p_witness.dtype)
    g_ptr = tl.load(row + 1).to(g_witness.dtype)
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # every pointer is 16-byte aligned (checked by the launcher): vector loads
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    numel = tl.load(row + 4)
    first = tl.load(row + 5)
    step_size = tl.load(scalars + t * 2)
    bc2_sqrt = tl.load(scalars + t * 2 + 1)
    start = (pid - first) * CHUNK
    _adam_chunk(p_ptr, g_ptr, m_ptr, v_ptr, start, numel, step_size, bc2_sqrt, decay, l2_wd, one_minus_beta1, beta2,
                one_minus_beta2, eps, ADAM_W_MODE, CHUNK, BLOCK)


@triton.jit
def _adam_flat_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, numel, step_size, bc2_sqrt,
    decay, l2_wd, one_minus_beta1, beta2, one_minus_beta2, eps,
    ADAM_W_MODE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """One tensor (a flat ZeRO partition): the pointers and step scalars are kernel arguments, so
    nothing but param, grad and the two moments is read. Program pid: elements [pid * CHUNK, +CHUNK)."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    _adam_chunk(p_ptr, g_ptr, m_ptr, v_ptr, start, numel, step_size, bc2_sqrt, decay, l2_wd, one_minus_beta1, beta2,
                one_minus_beta2, eps, ADAM_W_MODE, CHUNK, BLOCK)


def _program_map(numels: tuple[int, ...], device: torch.device) -> tuple[Tensor, list[int], int]:
    """(program -> tensor index map on ``device``, first program of each tensor, n_programs); cached."""
    firsts, total = [], 0
    for n in numels:
        firsts.append(total)
        total += triton.cdiv(n, CHUNK)
    key = (numels, str(device))
    cached = _program_maps.get(key)
    if cached is None:
        counts = torch.tensor([triton.cdiv(n, CHUNK) for n in numels], dtype=torch.int64)
        cached = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts).to(device)
        if len(_program_maps) >= _MAX_CACHED_MAPS:
            _program_maps.pop(next(iter(_program_maps)))
        _program_maps[key] = cached
    return cached, firsts, total


def adam_step(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    scalars: list[tuple[float, float]], lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, adam_w_mode: bool,
) -> None:
    """Launch the kernel once over tensors that share a device, a param dtype and a grad dtype.

    scalars: per tensor (step_size, sqrt(bc2)) from reference.step_scalars. Inputs are checked by
    the op (contiguous, matching shapes, fp32 states).
    """
    if len(params) == 1:  # one tensor: no table (see _adam_flat_kernel)
        numel = params[0].numel()
        if numel:
            _adam_flat_kernel[(triton.cdiv(numel, CHUNK),)](
                params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], numel, *scalars[0],
                1.0 - lr * weight_decay, weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps,
                ADAM_W_MODE=adam_w_mode, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4,
            )
        return
    numels = tuple(p.numel() for p in params)
    device = params[0].device
    program_tensor, firsts, n_programs = _program_map(numels, device)
    if n_programs == 0:
        return
    rows = [
        [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, first]
        for p, g, m, v, n, first in zip(params, grads, exp_avgs, exp_avg_sqs, numels, firsts)
    ]
    aligned = all(ptr % 16 == 0 for row in rows for ptr in row[:4])
    table = torch.tensor(rows, dtype=torch.int64).to(device)
    scalar_table = torch.tensor(scalars, dtype=torch.float32).to(device)
    _adam_kernel[(n_programs,)](
        table, scalar_table, program_tensor, params[0], grads[0],
        1.0 - lr * weight_decay, weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        ADAM_W_MODE=adam_w_mode, ALIGNED=aligned, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4,
    )
