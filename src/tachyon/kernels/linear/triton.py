"""Triton GEMMs with an elementwise epilogue: the activation of an MLP fused into the GEMM around it.

An MLP computes out = act(x W1^T + b1) W2^T. With cuBLAS GEMMs, the [tokens, ffn] tensor between
them makes extra trips through memory: the first GEMM writes x W1^T, a bias + activation kernel
reads it back and writes act(.); in backward the second GEMM's dX writes dY = dout W2, and the
activation's backward reads it and the pre-activation back to write dpre. Here those elementwise
passes run on the GEMM's fp32 accumulator before anything is stored:

    forward   (mode 0)   pre = x W1^T + b1  (kept for backward),  y = act(pre)      both stored
    backward  (mode 1)   dpre = (dout W2) * act'(pre)  (pre read in the epilogue), and the
                         fp32 column sums of dpre (b1's gradient) as one partial row per row block

Gated activations (swiglu, geglu; W1's rows are [gate | value] halves): the forward program
accumulates the gate tile (columns n of x W1^T) and the value tile (columns F + n) from the same x
tile and writes both pre-activation halves and y = act(gate) * value; the backward epilogue reads
both halves of pre and writes both halves of dpre.

The activation is computed once per element of the output (the epilogue), never in the GEMM's main
loop. y is computed from pre rounded to the output dtype, as the unfused chain computes it from
the stored pre-activation. fp32 inputs use IEEE fp32 dots (no TF32), as torch's default matmul;
under the CPU interpreter bf16 operands are widened to fp32 before the dot (the interpreter's bf16
dot is wrong), which changes the values, not the addresses read.

Grid: one program per [BLOCK_M, BLOCK_N] output tile, in groups of GROUP_M row blocks so that
programs running together share B's column blocks in cache. On a GPU the kernel autotunes over a
few BLOCK_N / BLOCK_K / warps / stages; BLOCK_M is the launcher's (the partial sums have one row
per row block); under the interpreter there is one small config.

Traced by torch.compile, a pointer the kernel does not touch (no bias; no partial sums) is a
tensor of its own instead of another argument (kernels/launch.py: a traced launch passes no
aliasing arguments). The
autotuner runs as torch.compile's backend has it: Inductor benchmarks the configs itself; the
eager and aot_eager backends launch through Triton's Autotuner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.backend import triton_interpreting
from tachyon.kernels.activation.reference import is_gated
from tachyon.kernels.activation.triton import _act_fwd, _act_fwd_grad, _code
from tachyon.kernels.tiling import partials, sum_partials
from tachyon.kernels.ints import cdiv
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch

GROUP_M = 8


def _configs() -> list[triton.Config]:
    if triton_interpreting():  # each interpreted program costs milliseconds: few, large blocks
        return [triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in ((128, 64, 8, 3), (256, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 4), (128, 128, 8, 2))]


def _prune(configs, named_args, **kwargs):
    """Gated forward tiles hold two accumulators: keep BLOCK_N <= 128 there; fp32 halves BLOCK_K."""
    esize = named_args["A"].element_size()
    kept = [c for c in configs
            if (not kwargs["B_GATED"] or c.kwargs["BLOCK_N"] <= 128)
            and esize * c.kwargs["BLOCK_K"] * (kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"] * (2 if kwargs["B_GATED"] else 1))
            * max(c.num_stages, 1) <= 200 * 1024]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])]


@fast_launch
@triton.autotune(configs=_configs(), key=["M", "N", "K", "MODE", "ACT", "GATED"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemm_act_kernel(
    A, B, BIAS, OUT, PRE, PART, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_pm, value_col0,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, B_GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """C [M, N] = A [M, K] @ B [K, N] (fp32 accumulator), then the epilogue of ``MODE``:

    0: pre = C + BIAS (and the value half from B's columns value_col0 + n when gated) stored to
       PRE [M, N or 2N]; OUT [M, N] = act(pre) (* pre_value).
    1: pre read from PRE [M, N or 2N]; OUT [M, N or 2N] = dpre; PART row pid_m = column sums of dpre.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP * num_n
    first_m = (pid // in_group) * GROUP
    rows_in_group = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % in_group) % rows_in_group
    pid_n = (pid % in_group) // rows_in_group
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        b_mask = k_valid[:, None] & n_valid[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if B_GATED:
            bv = tl.load(b_ptrs + value_col0 * stride_bn, mask=b_mask, other=0.0)
            if UPCAST:
                bv = bv.to(tl.float32)
            acc_v += tl.dot(a, bv, input_precision=DOT_PRECISION)
    mask = m_valid[:, None] & n_valid[None, :]
    pre_ptrs = PRE + offs_m[:, None] * stride_pm + offs_n[None, :]
    out_ptrs = OUT + offs_m[:, None] * stride_om + offs_n[None, :]
    if MODE == 0:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        pre = acc.to(PRE.dtype.element_ty)
        tl.store(pre_ptrs, pre, mask=mask)
        y = _act_fwd(pre.to(tl.float32), ACT)
        if GATED:
            if HAS_BIAS:
                acc_v += tl.load(BIAS + value_col0 + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            pre_v = acc_v.to(PRE.dtype.element_ty)
            tl.store(pre_ptrs + value_col0, pre_v, mask=mask)
            y = y * pre_v.to(tl.float32)
        tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=mask)
    else:
        h = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
        act, dact = _act_fwd_grad(h, ACT)
        if GATED:
            value = tl.load(pre_ptrs + value_col0, mask=mask, other=0.0).to(tl.float32)
            dpre = tl.where(mask, acc * value * dact, 0.0)
            dpre_v = tl.where(mask, acc * act, 0.0)
            tl.store(out_ptrs + value_col0, dpre_v.to(OUT.dtype.element_ty), mask=mask)
        else:
            dpre = tl.where(mask, acc * dact, 0.0)
        tl.store(out_ptrs, dpre.to(OUT.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            part = PART + pid_m * (N + value_col0)
            tl.store(part + offs_n, tl.sum(dpre, axis=0), mask=n_valid)
            if GATED:
                tl.store(part + value_col0 + offs_n, tl.sum(dpre_v, axis=0), mask=n_valid)


def _block_m(m: int) -> int:
    if triton_interpreting():
        return 64
    return 128 if m >= 128 else 64


def _launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, pre: torch.Tensor,
            part: torch.Tensor | None, n: int, mode: int, activation: str, b_strides: tuple[int, int],
            block_m: int) -> None:
    m, k = a.shape
    gated = is_gated(activation)
    ub, up = a, out  # the unused pointers' stand-ins
    if launch._wrapping:  # traced: a tensor of its own each (module docstring)
        ub, up = a.new_empty(0), out.new_empty(0, dtype=torch.float32)
    _gemm_act_kernel[lambda meta: (cdiv(m, block_m) * cdiv(n, meta["BLOCK_N"]),)](
        a, b, bias if bias is not None else ub, out, pre, part if part is not None else up, m, n, k,
        a.stride(0), a.stride(1), b_strides[0], b_strides[1], out.stride(0), pre.stride(0), n if gated else 0,
        MODE=mode, ACT=_code(activation), GATED=gated, B_GATED=gated and mode == 0,
        HAS_BIAS=(bias if mode == 0 else part) is not None,
        UPCAST=triton_interpreting() and a.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=block_m, GROUP=GROUP_M,
    )


def gemm_bias_act(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [R, K] (R = F, or 2F gated), bias [R] or None -> (pre [M, R], y [M, F]),
    both in x's dtype: pre = x weight^T + bias, y = act(pre)."""
    m = x.shape[0]
    rows = weight.shape[0]
    f = rows // 2 if is_gated(activation) else rows
    pre = torch.empty((m, rows), dtype=x.dtype, device=x.device)
    y = torch.empty((m, f), dtype=x.dtype, device=x.device)
    if m and f:
        _launch(x, weight, bias, y, pre, None, f, 0, activation, (weight.stride(1), weight.stride(0)), _block_m(m))
    return pre, y


def gemm_act_grad(dout: torch.Tensor, weight2: torch.Tensor, pre: torch.Tensor, activation: str,
                  bias_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dout [M, O], weight2 [O, F], pre [M, R] -> (dpre [M, R] in pre's dtype, the column sums
    of dpre in bias_dtype, or None when bias_dtype is None): dpre = act'(pre) * (dout weight2)."""
    m = dout.shape[0]
    rows = pre.shape[1]
    f = weight2.shape[1]
    dpre = torch.empty_like(pre)
    if m == 0 or f == 0:
        return dpre, (torch.zeros(rows, dtype=bias_dtype, device=pre.device) if bias_dtype is not None else None)
    block_m = _block_m(m)
    part = partials(cdiv(m, block_m), 1, rows, pre.device) if bias_dtype is not None else None
    _launch(dout, weight2, None, dpre, pre, part, f, 1, activation,
            (weight2.stride(0), weight2.stride(1)), block_m)
    return dpre, (sum_partials(part, [bias_dtype])[0] if part is not None else None)
