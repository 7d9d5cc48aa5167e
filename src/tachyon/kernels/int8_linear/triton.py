"""Triton weight-only INT8 GEMM: y = act(x @ (Q * scales)^T + bias), dequantized in registers.

Grid: (row blocks of x, column blocks of the output, K splits). A program loads an int8 tile of
Q [BLOCK_N, BLOCK_K] (half the bytes of fp16 weights: the point at decode, where the step time is
the time to stream the weights), converts it to x's dtype in registers (exact: |Q| <= 127) and
accumulates tl.dot(x, Q^T) in fp32. Per-channel scales multiply the accumulator once at the end;
group-wise scales multiply each K block's partial product (BLOCK_K divides the group size, so a
block never straddles two groups).

Epilogue (fp32, once per output element): + bias, then the optional activation of
kernels/activation (the same closed forms as ``bias_act``). A gated activation (swiglu, geglu)
reads Q as [gate rows | value rows] (2F rows for F outputs): a program accumulates the gate tile
(rows n) and the value tile (rows F + n) from the same x tile and writes act(gate) * value, so the
[M, 2F] pre-activation never reaches memory.

Prologue (optional, for decode: up to PROLOGUE_ROWS rows): the norm before the GEMM (LayerNorm or RMSNorm of x + residual,
kernels/layernorm's math) runs inside it: each program first walks its rows' K columns for the
mean and rstd (the rows are a few KB at decode), then normalizes every x tile as it loads it; the
programs of the first column block also store x + residual, the residual stream the next block
adds to. The [M, K] norm output is never written, and the norm costs no launch of its own. More
rows (prefill) run the norm kernel of kernels/layernorm first, then the GEMM.

Decode (M <= 16 rows): BLOCK_M is 16 and the K dimension is split over programs so that the whole
GPU streams weights (a [16, 4096] x [4096, 1600] product otherwise runs ~25 programs); each split
writes its fp32 partial [M, rows of Q], and one reduce kernel sums the splits and runs the same
epilogue (bias, activation, the cast to x's dtype): two launches in all, whatever the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.backend import triton_interpreting
from tachyon.kernels.activation.reference import is_gated
from tachyon.kernels.activation.triton import _act_fwd, _code
from tachyon.kernels.tiling import sm_count
from tachyon.kernels.ints import cdiv, next_power_of_2
from tachyon.kernels.launch import fast_launch


@triton.jit
def _epilogue(acc, acc_v, B, offs_n, n_valid, value_row0, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
              GATED: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] -> act(acc + b[n]) (* (acc_v + b[value_row0 + n]) when gated)."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_v += tl.load(B + value_row0 + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if ACT >= 0:
        acc = _act_fwd(acc, ACT)
    if GATED:
        acc = acc * acc_v
    return acc


@triton.jit
def _load_z(X, R, offs_m, offs_k, mask, stride_xm, stride_rm, HAS_RES: tl.constexpr):
    """z = x (+ residual) tile, rounded to x's dtype as the unfused add would store it."""
    z = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        z = (z.to(tl.float32) + r.to(tl.float32)).to(z.dtype)
    return z


@triton.jit
def _norm_stats(X, R, Z, offs_m, m_valid, K, stride_xm, stride_rm, stride_zm, eps, write_z,
                NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """(mean, rstd) fp32 [BLOCK_M] of the rows z = x (+ residual) over all K columns, as the norm
    kernels compute them (mean first, then the mean square of z - mean; mean 0 for RMSNorm).
    When ``write_z`` (one program per row block), z is stored to Z on the first pass."""
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = m_valid[:, None] & (offs_k < K)[None, :]
        z = _load_z(X, R, offs_m, offs_k, mask, stride_xm, stride_rm, HAS_RES)
        if HAS_RES:
            tl.store(Z + offs_m[:, None] * stride_zm + offs_k[None, :], z, mask=mask & write_z)
        total += tl.sum(z.to(tl.float32), axis=1)
    if NORM == 1:
        mean = total / K
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = m_valid[:, None] & (offs_k < K)[None, :]
        z = _load_z(X, R, offs_m, offs_k, mask, stride_xm, stride_rm, HAS_RES).to(tl.float32)
        centered = tl.where(mask, z - mean[:, None], 0.0)
        squares += tl.sum(centered * centered, axis=1)
    return mean, 1.0 / tl.sqrt(squares / K + eps)


@fast_launch
@triton.jit
def _int8_linear_kernel(
    X, W, S, B, OUT, PART, M, N, K, stride_xm, stride_wn, stride_sn, stride_om, group_size, split_k, value_row0,
    R, NW, NB, Z, stride_rm, stride_zm, eps,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_NB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """N: output columns (F when gated; Q then has 2F rows, the value rows from value_row0 = F).
    NORM 1 (LayerNorm) / 2 (RMSNorm): x is first normalized over its K columns, x (+ R) the
    norm's input, NW / NB its weight and bias; Z receives x + R (HAS_RES)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_valid = offs_m < M
    n_valid = offs_n < N
    k_per_split = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if NORM > 0:
        mean, rstd = _norm_stats(X, R, Z, offs_m, m_valid, K, stride_xm, stride_rm, stride_zm, eps,
                                 (pid_n == 0) & (pid_k == 0), NORM, HAS_RES, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_hi
        x_mask = m_valid[:, None] & k_valid[None, :]
        if NORM > 0:  # the norm's output tile, rounded to x's dtype as the norm kernel stores it
            z = _load_z(X, R, offs_m, offs_k, x_mask, stride_xm, stride_rm, HAS_RES)
            y = (z.to(tl.float32) - mean[:, None]) * rstd[:, None]
            y = y * tl.load(NW + offs_k, mask=k_valid, other=0.0).to(tl.float32)[None, :]
            if HAS_NB:
                y += tl.load(NB + offs_k, mask=k_valid, other=0.0).to(tl.float32)[None, :]
            x = tl.where(x_mask, y, 0.0).to(z.dtype)
        else:
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = n_valid[:, None] & k_valid[None, :]
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        if GATED:
            wv = tl.load(W + (value_row0 + offs_n)[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0)
            part_v = tl.dot(x, tl.trans(wv.to(x.dtype)), input_precision=DOT_PRECISION)
        if GROUPED:
            s = tl.load(S + offs_n * stride_sn + k0 // group_size, mask=n_valid, other=0.0)
            acc += part * s[None, :]
            if GATED:
                sv = tl.load(S + (value_row0 + offs_n) * stride_sn + k0 // group_size, mask=n_valid, other=0.0)
                acc_v += part_v * sv[None, :]
        else:
            acc += part
            if GATED:
                acc_v += part_v
    if not GROUPED:
        acc = acc * tl.load(S + offs_n * stride_sn, mask=n_valid, other=0.0)[None, :]
        if GATED:
            acc_v = acc_v * tl.load(S + (value_row0 + offs_n) * stride_sn, mask=n_valid, other=0.0)[None, :]
    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT:  # PART: [split_k, M, rows of Q] fp32; the reduce kernel runs the epilogue
        rows = N + value_row0 if GATED else N
        base = PART + (pid_k * M + offs_m[:, None]) * rows
        tl.store(base + offs_n[None, :], acc, mask=mask)
        if GATED:
            tl.store(base + value_row0 + offs_n[None, :], acc_v, mask=mask)
    else:
        acc = _epilogue(acc, acc_v, B, offs_n, n_valid, value_row0, HAS_BIAS, ACT, GATED)
        tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _split_reduce_kernel(
    PART, B, OUT, M, N, splits, stride_om, value_row0,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """OUT[m, n] = epilogue(sum_s PART[s, m, n] (, sum_s PART[s, m, value_row0 + n]))."""
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_valid = offs_n < N
    mask = (offs_m < M)[:, None] & n_valid[None, :]
    rows = N + value_row0 if GATED else N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, splits):
        base = PART + (s * M + offs_m[:, None]) * rows
        acc += tl.load(base + offs_n[None, :], mask=mask, other=0.0)
        if GATED:
            acc_v += tl.load(base + value_row0 + offs_n[None, :], mask=mask, other=0.0)
    acc = _epilogue(acc, acc_v, B, offs_n, n_valid, value_row0, HAS_BIAS, ACT, GATED)
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


# The norm prologue for up to this many rows (decode); above it (prefill) the norm kernel runs first:
# the prologue recomputes each row block's statistics in every column block's program, which is
# free for a few KB of decode rows and not for a prefill's [tokens, hidden].
PROLOGUE_ROWS = 16


def _blocks(m: int, k: int, group_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps); BLOCK_K divides the scale group (group_cols)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if triton_interpreting():
        block_n, block_k = 16, 32
    else:
        block_n, block_k = (64, 128) if m <= 16 else (64, 64)
    block_k = min(block_k, max(16, next_power_of_2(k)))
    if group_cols < k:
        while group_cols % block_k:
            block_k //= 2
    return block_m, block_n, block_k, 4


def _split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    sms = sm_count(device)
    if not sms:
        return 1
    wanted = cdiv(2 * sms, max(programs, 1))
    return max(1, min(wanted, cdiv(k, 4 * block_k), 32))


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, split_k: int | None,
    activation: str | None = None, norm: tuple | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride in K), qweight int8 [R, K] contiguous, scales fp32 [R, G] contiguous,
    bias [R] or None -> act(x @ W~^T + bias) [M, N] contiguous in x's dtype (N = R, or R / 2 for
    a gated activation).

    ``norm`` = (residual [M, K] or None, weight [K], bias [K] or None, eps, is_rms): x is replaced
    by norm(x + residual) in the GEMM's prologue; returns (y, z) with z = x + residual [M, K] in
    x's dtype (an empty tensor without a residual)."""
    if norm is not None and x.shape[0] > PROLOGUE_ROWS:  # prefill: the norm kernel, then the GEMM
        from tachyon.kernels.layernorm.triton import norm_fwd

        residual, norm_w, norm_b, eps, is_rms = norm
        h, z, _, _ = norm_fwd(x, norm_w, norm_b, residual, eps, is_rms, store_mean=False)
        return int8_linear(h, qweight, scales, bias, split_k, activation), (z if z is not None else x.new_empty(0))
    if x.dtype == torch.bfloat16 and triton_interpreting():  # the interpreter's bf16 tl.dot is wrong
        if norm is None:
            return int8_linear(x.float(), qweight, scales, bias, split_k, activation).to(x.dtype)
        residual = norm[0]
        if residual is not None:  # z rounded to bf16 as the kernel would, then the fp32 path
            x, norm = (x.float() + residual.float()).to(x.dtype), (None, *norm[1:])
        y, _ = int8_linear(x.float(), qweight, scales, bias, split_k, activation, norm)
        return y.to(x.dtype), (x if residual is not None else x.new_empty(0))
    m, k = x.shape
    rows = qweight.shape[0]
    gated = activation is not None and is_gated(activation)
    n = rows // 2 if gated else rows
    groups = scales.shape[1]
    group_cols = k // groups
    block_m, block_n, block_k, warps = _blocks(m, k, group_cols)
    if groups > 1 and group_cols % block_k:
        raise ValueError(f"int8_linear (triton): a scale group of {group_cols} columns needs to be a multiple of 16")
    grid_mn = (cdiv(m, block_m), cdiv(n, block_n))
    splits = split_k or _split_k(grid_mn[0] * grid_mn[1], k, block_k, x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, rows), dtype=torch.float32, device=x.device) if splits > 1 else out
    b = bias if bias is not None else scales
    epilogue = {"HAS_BIAS": bias is not None, "ACT": -1 if activation is None else _code(activation), "GATED": gated}
    residual, norm_w, norm_b, eps, is_rms = norm if norm is not None else (None, None, None, 0.0, False)
    z = torch.empty_like(x) if residual is not None else x.new_empty(0)
    _int8_linear_kernel[(*grid_mn, splits)](
        x, qweight, scales, b, out, part, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), group_cols, splits, n if gated else 0,
        residual if residual is not None else x, norm_w if norm is not None else x,
        norm_b if norm_b is not None else x, z if residual is not None else x,
        residual.stride(0) if residual is not None else 0, z.stride(0) if residual is not None else 0, float(eps),
        GROUPED=groups > 1, SPLIT=splits > 1, **epilogue,
        NORM=0 if norm is None else (2 if is_rms else 1), HAS_RES=residual is not None, HAS_NB=norm_b is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None, num_warps=warps,
    )
    if splits > 1:
        _split_reduce_kernel[grid_mn](part, b, out, m, n, splits, out.stride(0), n if gated else 0, **epilogue,
                                      BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return out if norm is None else (out, z)
