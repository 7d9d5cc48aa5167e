"""Triton weight-only INT8 GEMM: y = x @ (Q * scales)^T + bias, dequantized in registers.

Grid: (row blocks of x, column blocks of the output, K splits). A program loads an int8 tile of
Q [BLOCK_N, BLOCK_K] (half the bytes of fp16 weights: the point at decode, where the step time is
the time to stream the weights), converts it to x's dtype in registers (exact: |Q| <= 127) and
accumulates tl.dot(x, Q^T) in fp32. Per-channel scales multiply the accumulator once at the end;
group-wise scales multiply each K block's partial product (BLOCK_K divides the group size, so a
block never straddles two groups).

Decode (M <= 16 rows): BLOCK_M is 16 and the K dimension is split over programs so that the whole
GPU streams weights (a [16, 4096] x [4096, 1600] product otherwise runs ~25 programs); the fp32
partials [splits, M, N] are summed by the launcher, which also adds the bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.backend import triton_interpreting


@triton.jit
def _int8_linear_kernel(
    X, W, S, B, OUT, PART, M, N, K, stride_xm, stride_wn, stride_sn, stride_om, group_size, split_k,
    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < k_hi
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
        if GROUPED:
            s = tl.load(S + offs_n * stride_sn + k0 // group_size, mask=n_valid, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if not GROUPED:
        acc = acc * tl.load(S + offs_n * stride_sn, mask=n_valid, other=0.0)[None, :]
    mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT:
        tl.store(PART + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


def _blocks(m: int, k: int, group_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps); BLOCK_K divides the scale group (group_cols)."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if triton_interpreting():
        block_n, block_k = 16, 32
    else:
        block_n, block_k = (64, 128) if m <= 16 else (64, 64)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if group_cols < k:
        while group_cols % block_k:
            block_k //= 2
    return block_m, block_n, block_k, 4


def _split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * sms, max(programs, 1))
    return max(1, min(wanted, triton.cdiv(k, 4 * block_k), 32))


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, split_k: int | None,
) -> torch.Tensor:
    """x [M, K] (unit stride in K), qweight int8 [N, K] contiguous, scales fp32 [N, G] contiguous,
    bias [N] or None -> [M, N] contiguous in x's dtype."""
    if x.dtype == torch.bfloat16 and triton_interpreting():  # the interpreter's bf16 tl.dot is wrong
        return int8_linear(x.float(), qweight, scales, bias, split_k).to(x.dtype)
    m, k = x.shape
    n = qweight.shape[0]
    groups = scales.shape[1]
    group_cols = k // groups
    block_m, block_n, block_k, warps = _blocks(m, k, group_cols)
    if groups > 1 and group_cols % block_k:
        raise ValueError(f"int8_linear (triton): a scale group of {group_cols} columns needs to be a multiple of 16")
    grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    splits = split_k or _split_k(grid_mn[0] * grid_mn[1], k, block_k, x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    _int8_linear_kernel[(*grid_mn, splits)](
        x, qweight, scales, bias if bias is not None else scales, out, part, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), group_cols, splits,
        GROUPED=groups > 1, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None, num_warps=warps,
    )
    if splits == 1:
        return out
    total = part.sum(dim=0)
    if bias is not None:
        total += bias.float()
    return total.to(x.dtype)
