"""Triton kernel for attention over a KV cache (no autograd; see op.py and reference.py).

Grid: (batch * kv_heads, row blocks, splits). A program owns BLOCK_M rows of one kv head's query
group, the rows r = gh * seq_q + i for query head kv_head * group + gh and query i, so the K/V
tiles it loads serve every query head of the GQA group (decode with group 8 reads the cache once,
not eight times). Each split walks its own range of cache slots with the online softmax; with one
split the program stores the normalized output, with several it stores the unnormalized
accumulator and its (max, sum) pair and the launcher combines the splits (flash-decoding: at
batch 1 a long cache would otherwise keep only batch * kv_heads programs busy).

Loop bounds come from the cache lengths loaded on the device, never from the host, so a decode
step can be captured in a CUDA graph: the grid depends only on the cache capacity. Scores are in
base 2 (exp2), with m the running max times log2(e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.backend import triton_interpreting
from tachyon.kernels.tiling import sm_count
from tachyon.kernels.ints import cdiv, next_power_of_2
from tachyon.kernels.launch import fast_launch

LOG2E = tl.constexpr(1.4426950408889634)


@fast_launch
@triton.jit
def _decode_attention_kernel(
    Q, K, V, LENS, BIAS, OUT, PART_ACC, PART_ML,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_bias_b,
    batch, heads, kv_heads, group, seq_q, split_len, sm_scale, window,
    HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_bk = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bk // kv_heads
    kvh = pid_bk % kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < group * seq_q
    qi = rows % seq_q
    head = kvh * group + rows // seq_q
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    length = tl.load(LENS + b).to(tl.int32)
    pos = length - seq_q + qi  # the slot of each row's query
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, tl.max(tl.where(row_valid, pos, -1), 0) + 1)
    if HAS_WINDOW:  # keys before the window of the block's first row are never seen
        lo = tl.maximum(lo, tl.min(tl.where(row_valid, pos, 2147483647), 0) - window + 1)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        n_valid = cols < hi
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (sm_scale * LOG2E)
        if HAS_BIAS:
            s += tl.load(BIAS + b * stride_bias_b + cols, mask=n_valid, other=float("-inf"))[None, :] * LOG2E
        visible = (cols[None, :] <= pos[:, None]) & n_valid[None, :]
        if HAS_WINDOW:
            visible &= cols[None, :] > pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        # partials [splits, b, heads, seq_q, (d | 2)], fp32, contiguous
        row_index = ((pid_s * batch + b) * heads + head) * seq_q + qi
        tl.store(PART_ACC + row_index[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(PART_ML + row_index * 2, m_i, mask=row_valid)
        tl.store(PART_ML + row_index * 2 + 1, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(OUT + b * stride_ob + head[:, None] * stride_oh + qi[:, None] * stride_om + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=out_mask)


def _blocks(group_rows: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps): tl.dot needs every block dim >= 16."""
    block_d = max(16, next_power_of_2(head_dim))
    block_m = max(16, min(64, next_power_of_2(group_rows)))
    if triton_interpreting():
        return block_m, 16, block_d, 4
    block_n = 64 if block_d <= 128 else 32
    return block_m, block_n, block_d, 4 if block_m * block_d <= 4096 else 8


def auto_splits(programs: int, capacity: int, block_n: int, device: torch.device) -> int:
    """Enough splits that about two programs run per SM, each with at least four key blocks."""
    sms = sm_count(device)
    if not sms:
        return 1
    wanted = cdiv(2 * sms, max(programs, 1))
    return max(1, min(wanted, cdiv(capacity, 4 * block_n), 64))


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lengths: torch.Tensor,
    bias: torch.Tensor | None, window: int | None, softmax_scale: float, num_splits: int | None,
) -> torch.Tensor:
    """q [b, h, sq, d], caches [b, kvh, S, d] (unit stride in d), lengths int [b], bias fp32
    [b, S] (-inf masked) or None. Returns out [b, h, sq, d] contiguous in q's dtype."""
    if q.dtype == torch.bfloat16 and triton_interpreting():  # the interpreter's bf16 tl.dot is wrong
        out = decode_attention(q.float(), k_cache.float(), v_cache.float(), cache_lengths, bias, window,
                               softmax_scale, num_splits)
        return out.to(q.dtype)
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block_m, block_n, block_d, warps = _blocks(group * seq_q, head_dim)
    row_blocks = cdiv(group * seq_q, block_m)
    splits = num_splits or auto_splits(batch * kv_heads * row_blocks, capacity, block_n, q.device)
    split_len = cdiv(cdiv(capacity, splits), block_n) * block_n
    splits = cdiv(capacity, split_len)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_acc = torch.empty((splits, batch, heads, seq_q, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, batch, heads, seq_q, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    _decode_attention_kernel[(batch * kv_heads, row_blocks, splits)](
        q, k_cache, v_cache, cache_lengths, bias if bias is not None else q, out, part_acc, part_ml,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        bias.stride(0) if bias is not None else 0,
        batch, heads, kv_heads, group, seq_q, split_len, softmax_scale, window if window is not None else 0,
        HEAD_DIM=head_dim, HAS_BIAS=bias is not None, HAS_WINDOW=window is not None, SPLIT=splits > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=warps,
    )
    if splits == 1:
        return out
    return combine_splits(part_acc, part_ml[..., 0], part_ml[..., 1]).to(q.dtype)


def combine_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Merge split-K partials: acc [splits, ..., d] unnormalized, m (base-2 max) and l [splits, ...].

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s; rows no split saw
    (every l_s = 0) give 0. Device tensor ops only (no host sync; capturable in a CUDA graph)."""
    big = m.amax(dim=0)
    big = torch.where(torch.isneginf(big), torch.zeros_like(big), big)
    w = torch.exp2(m - big)
    total = (w * l).sum(dim=0)
    out = (w[..., None] * acc).sum(dim=0)
    return torch.where(total[..., None] > 0, out / torch.where(total > 0, total, 1.0)[..., None], 0.0)
