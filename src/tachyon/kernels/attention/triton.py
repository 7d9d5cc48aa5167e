"""Flash-attention forward and backward in Triton (no autograd here; see op.py).

Shapes: q [b, h, sq, d], k, v [b, kvh, sk, d] with unit stride in d (other strides free),
key_padding_bias fp32 [b, sk] or None. Query head h reads kv head h // (h / kvh).

Forward, one program per (block of BLOCK_M query rows, batch * head): walks the key blocks with
the online softmax (running max m, running sum l, rescaled accumulator), and stores
out = acc / l and lse = m + log(l) (fp32; +inf on rows with no unmasked key, whose output is 0).
Causal programs stop at the last key block their rows can see. Each loop is split in two: the
blocks every row sees whole run without any mask, and only the blocks that cross seq_k or the
causal diagonal pay for the masking (the same split in the backward loops).

Backward, deterministic by default (no atomics), recomputing P = exp(S - lse) from q, k and lse:
1. dQ: one program per (block of BLOCK_M query rows, batch * head). It first computes
   delta = rowsum(dO * O) of its rows (fp32) and stores it, then loops over key blocks:
   dQ += dS K, dS = P * (dP - delta), dP = (dO V^T) * Z. (Computing delta here rather than in
   a kernel of its own saves a launch and a second read of dO.)
2. dK, dV: one program per (block of BLOCK_N keys, batch * kv head); it loops over the query
   heads of its GQA group and over the query blocks that can see its keys, reading the stored
   delta, accumulating dV += (P*Z)^T dO and dK += dS^T Q in fp32 registers.
One-kernel backward (``one_kernel=True``, deterministic): ``_bwd_one_kernel`` runs both steps in
one launch, program i doing step 2 for key block i and then step 1 for query block i (same block
functions, same sums: the same bits). No launch stores delta before the dK/dV loop, so that loop
recomputes it from O and dO per query block (O is re-read per block pair; delta is never
written). Causal, key block i sees the query blocks from i on and query block i the key blocks up
to i, so the programs' work is balanced.
Z is the dropout mask / (1 - p), regenerated wherever it is needed from tachyon.kernels.random's
16-bit draws (rows: (batch, head, query); eight keys per Philox call; ``keep_tile`` against the
integer threshold ``drop_t``).
The seed is a scalar argument (an int) or loaded from a 0-dim int64 tensor (SEED_FROM_PTR), the
form torch.compile and the BERT layer's on-device seed counter use.

Non-deterministic backward (``deterministic=False``, FlashAttention-2 style): a delta kernel
runs first and step 1 is folded into step 2. The dK/dV program already holds dS for each
(query block, its key block); it also
atomically adds dS K * scale into a zeroed fp32 dQ buffer, so P is recomputed once instead of
twice and one kernel launch is saved. Different key blocks add into the same dQ rows in an order
the GPU scheduler picks, so dQ is not bit-reproducible run to run (dK, dV and the forward are).

QKV bias (``qkv_bias``, attention_qkvpacked's fusion): q, k, v come from a QKV GEMM run without
its bias, and every kernel adds the bias slice of its head as it loads them. Its gradient is the
column sums of dq, dk, dv, made by the dK/dV program from what it holds: dk's and dv's rows of its
keys, and for q, sum_i dq_i = scale * sum_j (sum_i dS_ij) k_j over its keys, for each query head of
its group. Each program stores one row of fp32 partial sums; ``sum_partials`` adds the rows up
(one small launch instead of a reduction that reads all of dq, dk, dv again).

On GPU each kernel autotunes over a few block shapes (key: head_dim, flags, dtypes and a
power-of-two bucket of the sequence length); under the interpreter there is one small config.
fp32 inputs use IEEE fp32 dots (no TF32), so fp32 results match an fp32 reference.

Traced by torch.compile, the launch arguments differ in two ways. A pointer the kernel does not
touch (no padding bias, no QKV bias, the seed pointer of an int seed, the atomic dQ buffer of the
deterministic backward) is a tensor of its own instead of another argument (kernels/launch.py: a
traced launch passes no aliasing arguments). And the QKV-bias gradient's partial sums do not depend on the config the
autotuner picks: eagerly the launcher reads the chosen BLOCK_N after the launch (``best_config``)
and sums only the rows that config's programs wrote, but in a traced graph the config is chosen
when the graph runs (Inductor autotunes user kernels itself), after the sum was traced. So the
traced buffer is zero-filled, sized for the smallest BLOCK_N, and all its rows are summed: the
rows no program wrote add zeros, whatever config runs (the sums' order may differ from the eager
launch's in the last bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.backend import triton_interpreting
from tachyon.kernels.random.reference import dropout_threshold
from tachyon.kernels.random.triton import keep_tile, load_seed, seed_args
from tachyon.kernels.tiling import immediate_sums, partials, sum_partials
from tachyon.kernels.ints import cdiv, next_power_of_2, next_power_of_2_by_comparison
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch

LOG2E = tl.constexpr(1.4426950408889634)  # the kernels work in base 2: exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)


def _configs(gpu: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    if triton_interpreting():  # each interpreted program costs milliseconds: few, small blocks
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu]


def _prune(configs, named_args, **kwargs):
    """Drop tiles whose K/V pipeline would not fit in shared memory for large head dims."""
    block_d = kwargs["BLOCK_D"]
    esize = named_args["Q"].element_size()
    kept = [c for c in configs
            if esize * block_d * (c.kwargs["BLOCK_M"] + 2 * c.kwargs["BLOCK_N"] * max(c.num_stages, 1)) <= 200 * 1024]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


_KEY = ["HEAD_DIM", "IS_CAUSAL", "HAS_BIAS", "HAS_DROPOUT", "HAS_QKV_BIAS", "seq_bucket"]
# (BLOCK_M, BLOCK_N, num_warps, num_stages); the last of each list fits any head_dim up to 256
_FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2),
                         (32, 32, 4, 1)])
_DKDV_CONFIGS = _configs([(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1)])
_DQ_CONFIGS = _configs([(128, 64, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2), (32, 32, 4, 1)])
# the one-kernel backward: square tiles, so key block i and query block i cover the same rows
_ONE_KERNEL_CONFIGS = _configs([(64, 64, 4, 2), (128, 128, 8, 2), (32, 32, 4, 1)])


@triton.jit
def _plus_bias(x, b, HAS_QKV_BIAS: tl.constexpr):
    """x [rows, BLOCK_D] + the head's slice b [BLOCK_D] of the QKV bias (0 past head_dim), added
    as the kernels load q, k or v from a QKV GEMM run without its bias."""
    if HAS_QKV_BIAS:
        x = (x + b[None, :]).to(x.dtype)
    return x


@triton.jit
def _key_range(pid_m, seq_k, diag, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full_hi, hi) for the query block pid_m: keys [0, full_hi) need no mask; [full_hi, hi) cross
    seq_k or the causal diagonal; keys >= hi are masked for every row of the block (causal) and
    are skipped. Query i sees keys j <= i + diag when causal."""
    full_hi = (seq_k // BLOCK_N) * BLOCK_N
    hi = seq_k
    if IS_CAUSAL:
        hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + diag)
        full_hi = tl.minimum(full_hi, (tl.maximum(pid_m * BLOCK_M + diag + 1, 0) // BLOCK_N) * BLOCK_N)
    return full_hi, hi


@triton.jit
def _qkv_bias_slices(QKV_B, h, kvh, heads, kv_heads, offs_d, d_valid, HEAD_DIM: tl.constexpr,
                     HAS_QKV_BIAS: tl.constexpr):
    """The [BLOCK_D] slices of the packed QKV bias [(heads + 2 kv_heads) * HEAD_DIM] of query head
    h and kv head kvh (zeros where not HAS_QKV_BIAS, then never added)."""
    if HAS_QKV_BIAS:
        bq = tl.load(QKV_B + h * HEAD_DIM + offs_d, mask=d_valid, other=0.0)
        bk = tl.load(QKV_B + (heads + kvh) * HEAD_DIM + offs_d, mask=d_valid, other=0.0)
        bv = tl.load(QKV_B + (heads + kv_heads + kvh) * HEAD_DIM + offs_d, mask=d_valid, other=0.0)
    else:
        bq = tl.zeros(offs_d.shape, dtype=tl.float32)
        bk = bq
        bv = bq
    return bq, bk, bv


@triton.jit
def _fwd_block(
    acc, l_i, m_i, q, k_base, v_base, bias_row, bk, bv, start_n, offs_m, offs_n, offs_d, d_valid, row_offsets,
    stride_kn, stride_vn, seq_k, diag, qk_scale, drop_t, inv_keep, seed,
    IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax, in base 2 (scores, m times log2(e)). MASKED: the block
    crosses seq_k or the causal diagonal. Keys past seq_k get -inf scores whatever they hold."""
    cols = start_n + offs_n
    if MASKED:
        n_valid = cols < seq_k
        kv_mask = n_valid[:, None] & d_valid[None, :]
    else:
        kv_mask = d_valid[None, :]
    k = _plus_bias(tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0), bk,
                   HAS_QKV_BIAS)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_BIAS:
        if MASKED:  # out-of-range keys load -inf
            s += tl.load(bias_row + cols, mask=n_valid, other=float("-inf"))[None, :] * LOG2E
        else:
            s += tl.load(bias_row + cols)[None, :] * LOG2E
    if MASKED:
        if not HAS_BIAS:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        if IS_CAUSAL:
            s = tl.where(cols[None, :] <= offs_m[:, None] + diag, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: exp(-inf) = 0, no NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = keep_tile(seed, row_offsets, start_n, drop_t, BLOCK_M, BLOCK_N)
        p = tl.where(keep, p * inv_keep, 0.0)
    v = _plus_bias(tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0), bv,
                   HAS_QKV_BIAS)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@fast_launch
@triton.autotune(configs=_FWD_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fwd_kernel(
    Q, K, V, BIAS, OUT, LSE, QKV_B,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_bias_b,
    heads, group, seq_q, seq_k, seq_bucket, sm_scale, drop_t, inv_keep, seed, SEED_PTR,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    h = bh % heads
    kvh = h // group
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < seq_q
    d_valid = offs_d < HEAD_DIM
    bq, bk, bv = _qkv_bias_slices(QKV_B, h, kvh, heads, heads // group, offs_d, d_valid, HEAD_DIM, HAS_QKV_BIAS)
    q = _plus_bias(tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                           mask=m_valid[:, None] & d_valid[None, :], other=0.0), bq, HAS_QKV_BIAS)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    bias_row = BIAS + b * stride_bias_b
    diag = seq_k - seq_q  # query i sees keys j <= i + diag when causal
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_offsets = (bh * seq_q + offs_m) * ((seq_k + 7) // 8)  # int64: each row's first dropout Philox counter
    full_hi, hi = _key_range(pid_m, seq_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, full_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, bias_row, bk, bv, start_n, offs_m, offs_n, offs_d, d_valid,
            row_offsets, stride_kn, stride_vn, seq_k, diag, sm_scale * LOG2E, drop_t, inv_keep, seed,
            IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, False, DOT_PRECISION, HAS_QKV_BIAS, BLOCK_M, BLOCK_N)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, k_base, v_base, bias_row, bk, bv, start_n, offs_m, offs_n, offs_d, d_valid,
            row_offsets, stride_kn, stride_vn, seq_k, diag, sm_scale * LOG2E, drop_t, inv_keep, seed,
            IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, True, DOT_PRECISION, HAS_QKV_BIAS, BLOCK_M, BLOCK_N)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)  # natural log, as the reference
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    tl.store(LSE + bh * seq_q + offs_m, lse, mask=m_valid)


@fast_launch
@triton.jit
def _bwd_delta_kernel(
    OUT, DO, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    heads, seq_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // heads
    h = bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seq_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * seq_q + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _dkdv_block(
    dk, dv, ds_sum, k, v, bias, bq, q_base, do_base, o_base, lse_row, delta_row, dq_base, start_m, start_n, offs_m0, offs_n,
    offs_d, d_valid, stride_qm, stride_dom, stride_om, seq_q, seq_k, diag, sm_scale, qk_scale, drop_t, inv_keep,
    seed, drop_base, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_QKV_BIAS: tl.constexpr, DELTA_FROM_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One query block's contribution to dK, dV of a key block. Rows past seq_q load lse = +inf,
    so their P is 0; columns past seq_k only touch rows of dK/dV that are never stored. MASKED:
    the block crosses the causal diagonal. Base 2: bias is pre-scaled by log2(e).

    ATOMIC_DQ: also add this block's dQ = scale * dS K to the fp32 rows at dq_base (row stride
    HEAD_DIM) with atomics; P at keys past seq_k is zeroed first (it may overflow there).
    HAS_QKV_BIAS: also add dS's column sums to ds_sum [BLOCK_N] (for the q bias gradient).
    DELTA_FROM_OUT: delta = rowsum(dO * O) of the block's rows is computed here from O at o_base
    (the one-kernel backward, where no earlier launch stored it), else loaded from delta_row."""
    offs_m = start_m + offs_m0
    m_valid = offs_m < seq_q
    qd_mask = m_valid[:, None] & d_valid[None, :]
    q = _plus_bias(tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask, other=0.0), bq,
                   HAS_QKV_BIAS)
    do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(lse_row + offs_m, mask=m_valid, other=float("inf"))
    if DELTA_FROM_OUT:  # the same sum, in the same order, as the dQ kernel's
        o = tl.load(o_base + offs_m[:, None] * stride_om + offs_d[None, :], mask=qd_mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    else:
        delta = tl.load(delta_row + offs_m, mask=m_valid, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        s += bias[None, :]
    p = tl.exp2(s - lse[:, None] * LOG2E)
    if MASKED:
        p = tl.where(offs_n[None, :] <= offs_m[:, None] + diag, p, 0.0)
    if ATOMIC_DQ:
        p = tl.where(offs_n[None, :] < seq_k, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = keep_tile(seed, (drop_base + offs_m) * ((seq_k + 7) // 8), start_n, drop_t, BLOCK_M, BLOCK_N)
        pd = tl.where(keep, p * inv_keep, 0.0)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    else:
        pd = p
    dv += tl.dot(tl.trans(pd.to(do.dtype)), do, input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)
    if HAS_QKV_BIAS:  # rows past seq_q have P = 0, hence dS = 0
        ds_sum += tl.sum(ds, 0)
    if ATOMIC_DQ:
        dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * sm_scale
        tl.atomic_add(dq_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq, mask=qd_mask, sem="relaxed")
    return dk, dv, ds_sum


@triton.jit
def _dkdv_program(
    pid_n, b, kvh, seed, Q, K, V, BIAS, DO, LSE, DELTA, OUT, DK, DV, DQ_ACC, QKV_B, DB_PART,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_ob, stride_oh, stride_om, stride_dkb, stride_dkh, stride_dkn,
    stride_bias_b, stride_part, heads, kv_heads, group, seq_q, seq_k, sm_scale, drop_t, inv_keep,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, DELTA_FROM_OUT: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV of key block pid_n of kv head kvh in batch b (see _dkdv_block for ATOMIC_DQ and
    DELTA_FROM_OUT). HAS_QKV_BIAS: q, k, v get their bias slices added as loaded, and the program stores the
    QKV bias gradient's partial sums over its keys in row (b * cdiv(seq_k, BLOCK_N) + pid_n) of DB_PART
    [rows, (heads + 2 kv_heads) * HEAD_DIM] fp32: dk's and dv's column sums at their heads'
    columns, and for each query head of its group sum_i dq_i restricted to its keys,
    scale * sum_j (sum_i dS_ij) k_j (dQ = scale dS K summed over the rows)."""
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_valid = offs_n < seq_k
    d_valid = offs_d < HEAD_DIM
    kv_mask = n_valid[:, None] & d_valid[None, :]
    _, bk, bv = _qkv_bias_slices(QKV_B, kvh * group, kvh, heads, kv_heads, offs_d, d_valid, HEAD_DIM, HAS_QKV_BIAS)
    k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    if HAS_QKV_BIAS:  # keys past seq_k stay 0, as without the bias (their P is never stored)
        k = tl.where(kv_mask, k + bk[None, :], 0.0).to(K.dtype.element_ty)
        v = tl.where(kv_mask, v + bv[None, :], 0.0).to(V.dtype.element_ty)
    bias = k  # placeholder, read only when HAS_BIAS
    if HAS_BIAS:
        bias = tl.load(BIAS + b * stride_bias_b + offs_n, mask=n_valid, other=float("-inf")) * LOG2E
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    diag = seq_k - seq_q
    # query blocks [lo, full_lo) cross the diagonal; rows before lo see none of these keys,
    # rows from full_lo on see all of them
    lo = 0
    full_lo = 0
    if IS_CAUSAL:
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M, seq_q)
    part_row = DB_PART + (b * tl.cdiv(seq_k, BLOCK_N) + pid_n) * stride_part  # written only with HAS_QKV_BIAS
    for g in range(0, group):
        h = kvh * group + g
        bh = b * heads + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        o_base = OUT + b * stride_ob + h * stride_oh  # read only with DELTA_FROM_OUT
        dq_base = DQ_ACC + bh * seq_q * HEAD_DIM  # read only with ATOMIC_DQ: fp32 [b, h, sq, d] contiguous
        bq, _, _ = _qkv_bias_slices(QKV_B, h, kvh, heads, kv_heads, offs_d, d_valid, HEAD_DIM, HAS_QKV_BIAS)
        ds_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start_m in range(lo, full_lo, BLOCK_M):
            dk, dv, ds_sum = _dkdv_block(
                dk, dv, ds_sum, k, v, bias, bq, q_base, do_base, o_base, LSE + bh * seq_q, DELTA + bh * seq_q, dq_base,
                start_m, start_n, offs_m0, offs_n, offs_d, d_valid, stride_qm, stride_dom, stride_om, seq_q, seq_k, diag, sm_scale,
                sm_scale * LOG2E, drop_t, inv_keep, seed, bh * seq_q, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, True,
                ATOMIC_DQ, HEAD_DIM, DOT_PRECISION, HAS_QKV_BIAS, DELTA_FROM_OUT, BLOCK_M, BLOCK_N)
        for start_m in range(full_lo, seq_q, BLOCK_M):
            dk, dv, ds_sum = _dkdv_block(
                dk, dv, ds_sum, k, v, bias, bq, q_base, do_base, o_base, LSE + bh * seq_q, DELTA + bh * seq_q, dq_base,
                start_m, start_n, offs_m0, offs_n, offs_d, d_valid, stride_qm, stride_dom, stride_om, seq_q, seq_k, diag, sm_scale,
                sm_scale * LOG2E, drop_t, inv_keep, seed, bh * seq_q, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, False,
                ATOMIC_DQ, HEAD_DIM, DOT_PRECISION, HAS_QKV_BIAS, DELTA_FROM_OUT, BLOCK_M, BLOCK_N)
        if HAS_QKV_BIAS:  # this query head's bias gradient from these keys; keys past seq_k add nothing
            ds_sum = tl.where(n_valid, ds_sum, 0.0)
            dbq = tl.sum(ds_sum[:, None] * k.to(tl.float32), 0) * sm_scale
            tl.store(part_row + h * HEAD_DIM + offs_d, dbq, mask=d_valid)
    out_off = b * stride_dkb + kvh * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :]
    tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)
    if HAS_QKV_BIAS:
        dbk = tl.sum(tl.where(n_valid[:, None], dk, 0.0), 0) * sm_scale
        dbv = tl.sum(tl.where(n_valid[:, None], dv, 0.0), 0)
        tl.store(part_row + (heads + kvh) * HEAD_DIM + offs_d, dbk, mask=d_valid)
        tl.store(part_row + (heads + kv_heads + kvh) * HEAD_DIM + offs_d, dbv, mask=d_valid)


# DQ_ACC is zeroed before each timed config: the atomic variant accumulates into it
@fast_launch
@triton.autotune(configs=_DKDV_CONFIGS, key=_KEY + ["ATOMIC_DQ"], prune_configs_by={"early_config_prune": _prune},
                 reset_to_zero=["DQ_ACC"])
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, BIAS, DO, LSE, DELTA, DK, DV, DQ_ACC, QKV_B, DB_PART,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_bias_b, stride_part,
    heads, kv_heads, group, seq_q, seq_k, seq_bucket, sm_scale, drop_t, inv_keep, seed, SEED_PTR,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, ATOMIC_DQ: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    _dkdv_program(
        pid_n, bkv // kv_heads, bkv % kv_heads, seed, Q, K, V, BIAS, DO, LSE, DELTA, Q, DK, DV, DQ_ACC, QKV_B, DB_PART,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, 0, 0, 0, stride_dkb, stride_dkh, stride_dkn, stride_bias_b, stride_part,
        heads, kv_heads, group, seq_q, seq_k, sm_scale, drop_t, inv_keep, HEAD_DIM, IS_CAUSAL, HAS_BIAS,
        HAS_DROPOUT, ATOMIC_DQ, HAS_QKV_BIAS, False, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N)


@triton.jit
def _dq_block(
    dq, q, do, lse2, delta, k_base, v_base, bias_row, bk, bv, start_n, offs_m, offs_n, offs_d, d_valid, row_offsets,
    stride_kn, stride_vn, seq_k, diag, qk_scale, drop_t, inv_keep, seed,
    IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One key block's contribution to dQ (base 2: lse2 = lse * log2(e)). MASKED: the block crosses
    seq_k or the causal diagonal."""
    cols = start_n + offs_n
    if MASKED:
        n_valid = cols < seq_k
        kv_mask = n_valid[:, None] & d_valid[None, :]
    else:
        kv_mask = d_valid[None, :]
    k = _plus_bias(tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0), bk,
                   HAS_QKV_BIAS)
    v = _plus_bias(tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0), bv,
                   HAS_QKV_BIAS)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_BIAS:
        if MASKED:
            s += tl.load(bias_row + cols, mask=n_valid, other=float("-inf"))[None, :] * LOG2E
        else:
            s += tl.load(bias_row + cols)[None, :] * LOG2E
    p = tl.exp2(s - lse2[:, None])
    if MASKED:  # P at keys past seq_k may overflow: zero it before it meets dP
        allowed = n_valid[None, :] & (offs_m[:, None] >= 0)
        if IS_CAUSAL:
            allowed = allowed & (cols[None, :] <= offs_m[:, None] + diag)
        p = tl.where(allowed, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = keep_tile(seed, row_offsets, start_n, drop_t, BLOCK_M, BLOCK_N)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(
    pid_m, b, h, seed, Q, K, V, BIAS, DO, LSE, DELTA, DQ, OUT, QKV_B,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_bias_b,
    stride_ob, stride_oh, stride_om, heads, group, seq_q, seq_k, sm_scale, drop_t, inv_keep,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    STORE_DELTA: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ of query block pid_m of head h in batch b; delta = rowsum(dO * O) of its rows is computed
    first (and stored to DELTA when STORE_DELTA)."""
    bh = b * heads + h
    kvh = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < seq_q
    d_valid = offs_d < HEAD_DIM
    qd_mask = m_valid[:, None] & d_valid[None, :]
    bq, bk, bv = _qkv_bias_slices(QKV_B, h, kvh, heads, heads // group, offs_d, d_valid, HEAD_DIM, HAS_QKV_BIAS)
    q = _plus_bias(tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :], mask=qd_mask,
                           other=0.0), bq, HAS_QKV_BIAS)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :], mask=qd_mask, other=0.0)
    # base-2 logsumexp; rows past seq_q load +inf, so their P is 0
    lse2 = tl.load(LSE + bh * seq_q + offs_m, mask=m_valid, other=float("inf")) * LOG2E
    # delta = rowsum(dO * O) of its rows; stored for a dK/dV kernel that runs after this one
    o = tl.load(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :], mask=qd_mask,
                other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if STORE_DELTA:
        tl.store(DELTA + bh * seq_q + offs_m, delta, mask=m_valid)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    bias_row = BIAS + b * stride_bias_b
    diag = seq_k - seq_q
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_offsets = (bh * seq_q + offs_m) * ((seq_k + 7) // 8)
    full_hi, hi = _key_range(pid_m, seq_k, diag, IS_CAUSAL, BLOCK_M, BLOCK_N)  # the forward's split
    for start_n in range(0, full_hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, bias_row, bk, bv, start_n, offs_m, offs_n, offs_d,
                       d_valid, row_offsets, stride_kn, stride_vn, seq_k, diag, sm_scale * LOG2E, drop_t, inv_keep,
                       seed, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, False, DOT_PRECISION, HAS_QKV_BIAS, BLOCK_M, BLOCK_N)
    for start_n in range(full_hi, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, bias_row, bk, bv, start_n, offs_m, offs_n, offs_d,
                       d_valid, row_offsets, stride_kn, stride_vn, seq_k, diag, sm_scale * LOG2E, drop_t, inv_keep,
                       seed, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, True, DOT_PRECISION, HAS_QKV_BIAS, BLOCK_M, BLOCK_N)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=qd_mask)


@fast_launch
@triton.autotune(configs=_DQ_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, BIAS, DO, LSE, DELTA, DQ, OUT, QKV_B,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_bias_b,
    stride_ob, stride_oh, stride_om,
    heads, group, seq_q, seq_k, seq_bucket, sm_scale, drop_t, inv_keep, seed, SEED_PTR,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, STORE_DELTA: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    _dq_program(
        pid_m, bh // heads, bh % heads, seed, Q, K, V, BIAS, DO, LSE, DELTA, DQ, OUT, QKV_B,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_bias_b,
        stride_ob, stride_oh, stride_om, heads, group, seq_q, seq_k, sm_scale, drop_t, inv_keep,
        HEAD_DIM, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, STORE_DELTA, HAS_QKV_BIAS, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N)


@fast_launch
@triton.autotune(configs=_ONE_KERNEL_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _bwd_one_kernel(
    Q, K, V, BIAS, DO, LSE, OUT, DQ, DK, DV, QKV_B, DB_PART,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_ob, stride_oh, stride_om, stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn, stride_bias_b, stride_part,
    heads, kv_heads, group, seq_q, seq_k, seq_bucket, sm_scale, drop_t, inv_keep, seed, SEED_PTR,
    HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The whole backward in one launch: program (i, b * kv_heads + kvh) computes dK, dV of key
    block i (if i * BLOCK_N < seq_k) and then dQ of query block i for each query head of the
    group (if i * BLOCK_M < seq_q). delta is recomputed from O and dO where it is needed, since no
    earlier launch stores it. Causal: key block i loops over the query blocks at or after the
    diagonal and query block i over the key blocks before it, so every program has about the same
    work."""
    pid = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    b = bkv // kv_heads
    kvh = bkv % kv_heads
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    if pid * BLOCK_N < seq_k:
        _dkdv_program(
            pid, b, kvh, seed, Q, K, V, BIAS, DO, LSE, LSE, OUT, DK, DV, DK, QKV_B, DB_PART,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            stride_dob, stride_doh, stride_dom, stride_ob, stride_oh, stride_om, stride_dkb, stride_dkh, stride_dkn,
            stride_bias_b, stride_part, heads, kv_heads, group, seq_q, seq_k, sm_scale, drop_t, inv_keep,
            HEAD_DIM, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, False, HAS_QKV_BIAS, True, BLOCK_D, DOT_PRECISION, BLOCK_M,
            BLOCK_N)
    if pid * BLOCK_M < seq_q:
        for g in range(0, group):
            _dq_program(
                pid, b, kvh * group + g, seed, Q, K, V, BIAS, DO, LSE, LSE, DQ, OUT, QKV_B,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_bias_b,
                stride_ob, stride_oh, stride_om, heads, group, seq_q, seq_k, sm_scale, drop_t, inv_keep,
                HEAD_DIM, IS_CAUSAL, HAS_BIAS, HAS_DROPOUT, False, HAS_QKV_BIAS, BLOCK_D, DOT_PRECISION, BLOCK_M,
                BLOCK_N)


def _common(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, causal: bool, dropout_p: float,
            qkv_bias: torch.Tensor | None):
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    block_d = max(16, next_power_of_2(head_dim))
    if qkv_bias is not None and qkv_bias.shape != ((heads + 2 * kv_heads) * head_dim,):
        raise ValueError(f"attention (triton): qkv_bias must be [(heads + 2 * kv_heads) * head_dim] = "
                         f"[{(heads + 2 * kv_heads) * head_dim}]; got {tuple(qkv_bias.shape)}")
    flags = dict(
        HEAD_DIM=head_dim, IS_CAUSAL=causal, HAS_BIAS=bias is not None, HAS_DROPOUT=dropout_p > 0.0,
        HAS_QKV_BIAS=qkv_bias is not None,
        BLOCK_D=block_d, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32: no tf32 rounding
    )
    # traced: the sequence lengths may be symbolic; the bucket then guards on its range, not on them
    bucket = (next_power_of_2_by_comparison if launch._wrapping else next_power_of_2)(max(seq_q, seq_k))
    inv_keep = 1.0 / (1.0 - dropout_p)
    return batch, heads, kv_heads, seq_q, seq_k, bucket, inv_keep, flags


# Triton's interpreter computes bf16 tl.dot wrongly, so there bf16 inputs run the fp32 kernel
# (values right, but the casts around it are not what a GPU runs). Counting bytes and launches
# (tachyon.profiling.traffic, benchmarks/bench_traffic.py) sets this False to run the bf16
# kernels themselves: their addresses, hence bytes and launches, are the GPU's; values are not.
BF16_AS_FP32_UNDER_INTERPRETER = True


def _interpreted_bf16(q: torch.Tensor) -> bool:
    return q.dtype == torch.bfloat16 and BF16_AS_FP32_UNDER_INTERPRETER and triton_interpreting()


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ValueError(f"attention (triton): the last dim must have unit stride; got strides {t.stride()}")
    return t.stride(0), t.stride(1), t.stride(2)


def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
    dropout_p: float, seed: int | torch.Tensor, softmax_scale: float, out: torch.Tensor | None = None,
    qkv_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32).

    out: where to write the output (any strides with a unit last one, e.g. a view of a
    [b, sq, h, d] buffer); default a new contiguous tensor.
    qkv_bias: None or [(h + 2 kvh) * d] in q's dtype, laid out [q heads | k heads | v heads]: added
    to q, k and v as they are loaded (the bias of the QKV GEMM that produced them).
    seed: an int (a scalar kernel argument) or a 0-dim int64 tensor on q's device (loaded by the
    kernel; never read on the host)."""
    if _interpreted_bf16(q):
        out32, lse = attention_fwd(q.float(), k.float(), v.float(), bias, causal, dropout_p, seed, softmax_scale,
                                   qkv_bias=qkv_bias.float() if qkv_bias is not None else None)
        if out is None:
            return out32.to(q.dtype), lse
        return out.copy_(out32), lse
    batch, heads, kv_heads, seq_q, seq_k, bucket, inv_keep, flags = _common(q, k, bias, causal, dropout_p, qkv_bias)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    seed_int, seed_ptr, from_ptr = seed_args(seed, lse)
    ub = uqb = q  # the unused pointers' stand-ins
    if launch._wrapping:  # traced: a tensor of its own each (module docstring)
        ub, uqb = q.new_empty(0), q.new_empty(0)
        seed_ptr = seed_ptr if from_ptr else lse.new_empty(0)
    grid = lambda meta: (cdiv(seq_q, meta["BLOCK_M"]), batch * heads)  # noqa: E731
    _fwd_kernel[grid](
        q, k, v, bias if bias is not None else ub, out, lse, qkv_bias if qkv_bias is not None else uqb,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out), bias.stride(0) if bias is not None else 0,
        heads, heads // kv_heads, seq_q, seq_k, bucket, softmax_scale, dropout_threshold(dropout_p), inv_keep, seed_int, seed_ptr,
        SEED_FROM_PTR=from_ptr, **flags,
    )
    return out, lse


def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, bias: torch.Tensor | None, causal: bool, dropout_p: float, seed: int | torch.Tensor,
    softmax_scale: float, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    qkv_bias: torch.Tensor | None, deterministic: bool, one_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (dq, dk, dv, dqkv_bias or None) in the dtypes of q, k, v.

    grads: None (dq, dk, dv are new contiguous tensors) or the three tensors to write them into
    (any strides with a unit last one, dk and dv with the same strides: e.g. views of one
    [b, s, heads + 2 * kv_heads, d] buffer, the packed QKV gradient).
    qkv_bias: None, or the bias the forward added to q, k, v as it loaded them (see
    :func:`attention_fwd`); then the kernels add it again and dqkv_bias [(h + 2 kvh) * d] is the
    column sums of dq, dk, dv: the dK/dV kernel stores per-program partial sums, one more launch
    (``sum_partials``) adds them up.

    deterministic=True: two kernels, no atomics, bit-reproducible: dQ first, which also computes
    delta = rowsum(dO * O) for its query rows and stores it, then dK/dV, which reads it.
    deterministic=False: the delta kernel, then the dK/dV kernel, which also adds each block's dQ
    into a zeroed fp32 [b, h, sq, d] buffer with atomics (P is recomputed once instead of twice),
    then dQ is cast to q's dtype. The order of those fp32 additions varies from run to run on a
    GPU, so dQ may differ in its last bits between runs; dK and dV are unchanged.
    one_kernel=True (with deterministic): one launch, ``_bwd_one_kernel`` (dK/dV of key block i and
    dQ of query block i in program i; delta recomputed from O where needed, never stored), the
    same values bit for bit as the two kernels: one launch and delta's write and read fewer, O
    read once per (query block, key block) pair by the dK/dV loop."""
    if _interpreted_bf16(q):
        with immediate_sums():  # db32 is read (cast) right here: its reduction cannot wait for a deferred_sums block
            *grads32, db32 = attention_bwd(
                dout.float(), q.float(), k.float(), v.float(), out.float(), lse, bias, causal, dropout_p, seed,
                softmax_scale, None, qkv_bias.float() if qkv_bias is not None else None, deterministic,
                **({"one_kernel": True} if one_kernel else {}))
        db = db32.to(qkv_bias.dtype) if db32 is not None else None
        if grads is None:
            return (*(g.to(q.dtype) for g in grads32), db)
        return (*(g.copy_(g32) for g, g32 in zip(grads, grads32)), db)
    batch, heads, kv_heads, seq_q, seq_k, bucket, inv_keep, flags = _common(q, k, bias, causal, dropout_p, qkv_bias)
    if one_kernel and deterministic:
        return _attention_bwd_one_kernel(dout, q, k, v, out, lse, bias, dropout_p, seed, softmax_scale, grads, qkv_bias,
                                         batch, heads, kv_heads, seq_q, seq_k, bucket, inv_keep, flags)
    delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    if grads is not None:
        dq, dk, dv = grads
        if dk.stride() != dv.stride():
            raise ValueError(f"attention (triton): dk and dv must share strides; got {dk.stride()} and {dv.stride()}")
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if deterministic else None
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    seed_int, seed_ptr, from_ptr = seed_args(seed, delta)
    traced = launch._wrapping
    ub, uqb, udq, upart = q, q, dk, delta  # the unused pointers' stand-ins
    if traced:  # a tensor of its own each; the partial sums zero-filled, all rows summed (module docstring)
        ub, uqb, udq, upart = q.new_empty(0), q.new_empty(0), dk.new_empty(0), delta.new_empty(0)
        seed_ptr = seed_ptr if from_ptr else delta.new_empty(0)
    bias_arg = bias if bias is not None else ub
    bias_stride = bias.stride(0) if bias is not None else 0
    qkv_bias_arg = qkv_bias if qkv_bias is not None else uqb
    common = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout))
    if deterministic:
        _bwd_dq_kernel[lambda meta: (cdiv(seq_q, meta["BLOCK_M"]), batch * heads)](
            q, k, v, bias_arg, dout, lse, delta, dq, out, qkv_bias_arg, *common, *_strides3(dq), bias_stride,
            *_strides3(out), heads, heads // kv_heads, seq_q, seq_k, bucket, softmax_scale, dropout_threshold(dropout_p), inv_keep,
            seed_int, seed_ptr, SEED_FROM_PTR=from_ptr, STORE_DELTA=True, **flags,
        )
    else:
        block_delta = 32 if triton_interpreting() else 64
        _bwd_delta_kernel[(cdiv(seq_q, block_delta), batch * heads)](
            out, dout, delta, *_strides3(out), *_strides3(dout), heads, seq_q,
            HEAD_DIM=flags["HEAD_DIM"], BLOCK_D=flags["BLOCK_D"], BLOCK_M=block_delta,
        )
    # the atomic variant's fp32 dQ accumulator; otherwise a stand-in (never read or written)
    dq_acc = None if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # the bias gradient's partial sums: one row per dK/dV program, of which there are at most as
    # many as with the smallest BLOCK_N the autotuner may pick; only the chosen config's rows are summed
    part = None
    if qkv_bias is not None:
        smallest_block_n = min(c.kwargs["BLOCK_N"] for c in _bwd_dkdv_kernel.configs)
        part = partials(batch * cdiv(seq_k, smallest_block_n), 1, qkv_bias.numel(), q.device)
        if traced:
            part.zero_()
    _bwd_dkdv_kernel[lambda meta: (cdiv(seq_k, meta["BLOCK_N"]), batch * kv_heads)](
        q, k, v, bias_arg, dout, lse, delta, dk, dv, dq_acc if dq_acc is not None else udq, qkv_bias_arg,
        part if part is not None else upart,
        *common, *_strides3(dk), bias_stride, part.stride(0) if part is not None else 0,
        heads, kv_heads, heads // kv_heads, seq_q, seq_k, bucket,
        softmax_scale, dropout_threshold(dropout_p), inv_keep, seed_int, seed_ptr, SEED_FROM_PTR=from_ptr,
        ATOMIC_DQ=not deterministic, **flags,
    )
    dbias = None
    if part is not None:
        rows = part.shape[0] if traced else batch * cdiv(seq_k, _bwd_dkdv_kernel.best_config.kwargs["BLOCK_N"])
        (dbias,) = sum_partials(part[:rows], [qkv_bias.dtype])
    if dq_acc is not None:
        if dq is not None:
            return dq.copy_(dq_acc), dk, dv, dbias
        return (dq_acc if q.dtype == torch.float32 else dq_acc.to(q.dtype)), dk, dv, dbias
    return dq, dk, dv, dbias


def _attention_bwd_one_kernel(dout, q, k, v, out, lse, bias, dropout_p, seed, softmax_scale, grads, qkv_bias, batch,
                              heads, kv_heads, seq_q, seq_k, bucket, inv_keep, flags):
    """attention_bwd with one_kernel=True (see there)."""
    if grads is not None:
        dq, dk, dv = grads
        if dk.stride() != dv.stride():
            raise ValueError(f"attention (triton): dk and dv must share strides; got {dk.stride()} and {dv.stride()}")
    else:
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    seed_int, seed_ptr, from_ptr = seed_args(seed, lse)
    part = None
    if qkv_bias is not None:  # one row per key block, at most as many as with the smallest BLOCK_N
        smallest_block_n = min(c.kwargs["BLOCK_N"] for c in _bwd_one_kernel.configs)
        part = partials(batch * cdiv(seq_k, smallest_block_n), 1, qkv_bias.numel(), q.device)
    traced = launch._wrapping
    ub, uqb, up = q, q, lse  # the unused pointers' stand-ins
    if traced:  # a tensor of its own each; the partial sums zero-filled, all rows summed (module docstring)
        ub, uqb, up = q.new_empty(0), q.new_empty(0), lse.new_empty(0)
        seed_ptr = seed_ptr if from_ptr else lse.new_empty(0)
        if part is not None:
            part.zero_()

    def grid(meta):
        return max(cdiv(seq_k, meta["BLOCK_N"]), cdiv(seq_q, meta["BLOCK_M"])), batch * kv_heads

    _bwd_one_kernel[grid](
        q, k, v, bias if bias is not None else ub, dout, lse, out, dq, dk, dv,
        qkv_bias if qkv_bias is not None else uqb, part if part is not None else up,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(out), *_strides3(dq),
        *_strides3(dk), bias.stride(0) if bias is not None else 0, part.stride(0) if part is not None else 0,
        heads, kv_heads, heads // kv_heads, seq_q, seq_k, bucket, softmax_scale, dropout_threshold(dropout_p), inv_keep, seed_int,
        seed_ptr, SEED_FROM_PTR=from_ptr, **flags,
    )
    dbias = None
    if part is not None:
        rows = part.shape[0] if traced else batch * cdiv(seq_k, _bwd_one_kernel.best_config.kwargs["BLOCK_N"])
        (dbias,) = sum_partials(part[:rows], [qkv_bias.dtype])
    return dq, dk, dv, dbias

