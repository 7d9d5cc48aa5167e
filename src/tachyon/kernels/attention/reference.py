"""PyTorch attention: the autograd oracle, the memory-efficient CPU backend, and an SDPA adapter.

For q: [batch, heads, seq_q, head_dim], k, v: [batch, kv_heads, seq_k, head_dim] (query head h
reads kv head h // (heads // kv_heads): GQA, or MQA when kv_heads == 1):

    s[i, j]  = scale * <q_i, k_j> + bias[b, j]                (bias: key_padding_bias, 0 if None)
    s[i, j]  = -inf  where causal and j > i + (seq_k - seq_q)  (bottom-right aligned, as flash-attn)
    p        = softmax_j(s)                                    (in fp32)
    p_drop   = p * keep / (1 - dropout_p),   keep: dropout_keep (tachyon.kernels.random's mask, rows (b, h, i))
    out      = p_drop @ v

over the score rows (b * heads + h) * seq_q + i of seq_k keys, drawn by the shared Philox
generator (:mod:`tachyon.kernels.random`) so the Triton kernel drops exactly the same elements.
Every ``seed`` here is an int or a 0-dim int64 tensor on q's device (the same value gives the
same mask either way).

A bias at or below MASKED_BIAS (-32752, half of fp16's most negative value: HF's finfo.min in
fp16, bf16 or fp32 all qualify) counts as -inf, i.e. masked. Fully masked rows (every key at -inf,
from the bias or the causal mask) give out = 0 and zero gradients, never NaN. HF instead adds
finfo.min and gets the uniform average of all values on such rows; rows with one real key agree.
(Treating huge finite values as numbers would also break the backward: lse = m + log(l) rounds
to m at magnitude 1e38, and the recomputed probabilities would be 1 instead of 1/seq_k.) Moderate
negative biases (the old -10000 convention, ALiBi-like slopes) are added as they are.

Three implementations live here:

- :func:`attention_reference`: plain math on the materialized [seq_q, seq_k] scores, in fp32,
  differentiated by autograd. The test oracle.
- :func:`attention_forward` / :func:`attention_backward`: what the op runs on CPU (backend
  "torch"). Forward returns out and the fp32 logsumexp; backward recomputes the probabilities
  from q, k and the logsumexp and regenerates the dropout mask, so only q, k, v, out, lse (and the
  [batch, seq_k] bias) are kept between the two. Vectorized over batch and heads; the scores of
  one chunk of query rows are materialized at a time (chunks only when they would be large).
- :func:`sdpa_attention`: the same attention through torch's scaled_dot_product_attention (no
  dropout), for comparisons and benchmarks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tachyon.kernels.random import dropout_keep_rows

MASKED_BIAS = torch.finfo(torch.float16).min / 2  # bias values at or below this mean "masked" (-inf)

# Chunking budget of the CPU backend: fp32 score elements materialized at once (64 MiB).
_CHUNK_ELEMENTS = 1 << 24
_CHUNK_ELEMENTS_DROPOUT = 1 << 21  # Philox keeps ~6 int64 temporaries per element


_masked_cache: list = []  # [key padding bias, its _version, the masked bias]: one model's layers share a mask


def masked_bias(key_padding_bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias every implementation uses: fp32, contiguous, values <= MASKED_BIAS set to -inf.

    Eager calls reuse the last result while the same tensor, unchanged (its version counter), comes
    again: the layers of a model pass one mask, and this is four ops per layer otherwise. Under
    torch.compile the cache is skipped (dynamo would guard on it)."""
    if key_padding_bias is None:
        return None
    compiling = torch.compiler.is_compiling()
    if not compiling and _masked_cache and _masked_cache[0] is key_padding_bias \
            and _masked_cache[1] == key_padding_bias._version:
        return _masked_cache[2]
    bias = key_padding_bias.detach().float()
    bias = bias.masked_fill(bias <= MASKED_BIAS, float("-inf")).contiguous()
    if not compiling:
        _masked_cache[:] = [key_padding_bias, key_padding_bias._version, bias]
    return bias


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale in force: ``softmax_scale``, or 1 / sqrt(head_dim) when it is None."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def dropout_keep(seed: int | torch.Tensor, dropout_p: float, batch: int, heads: int, seq_q: int, seq_k: int,
                 rows: tuple[int, int] | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean keep mask [batch, heads, rows, seq_k] of the attention dropout (rows: query range).

    keep[b, h, i, :] = row (b * heads + h) * seq_q + i of tachyon.kernels.random.dropout_keep_rows
    over seq_k columns (16-bit draws, eight keys per Philox call).
    """
    i0, i1 = rows if rows is not None else (0, seq_q)
    bh = torch.arange(batch * heads, dtype=torch.int64, device=device).view(-1, 1)
    i = torch.arange(i0, i1, dtype=torch.int64, device=device).view(1, -1)
    return dropout_keep_rows(seed, (bh * seq_q + i).view(-1), seq_k, dropout_p).view(batch, heads, i1 - i0, seq_k)


def causal_allowed(seq_q: int, seq_k: int, rows: tuple[int, int] | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [rows, seq_k]: True where query i may attend key j, i.e. j <= i + (seq_k - seq_q)."""
    i0, i1 = rows if rows is not None else (0, seq_q)
    i = torch.arange(i0, i1, device=device).view(-1, 1)
    j = torch.arange(seq_k, device=device).view(1, -1)
    return j <= i + (seq_k - seq_q)


def _attention_math(q, k, v, causal, key_padding_bias, dropout_p, seed, softmax_scale, upcast):
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    group = heads // k.shape[1]
    scale = default_scale(head_dim, softmax_scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64 in: an fp64 oracle
    work = acc if upcast else q.dtype
    qw = q.to(work)
    kw = k.to(work).repeat_interleave(group, dim=1)
    vw = v.to(work).repeat_interleave(group, dim=1)
    s = (qw @ kw.transpose(-1, -2)).to(acc) * scale
    if key_padding_bias is not None:
        s = s + masked_bias(key_padding_bias).to(acc)[:, None, None, :]
    if causal:
        s = s.masked_fill(~causal_allowed(seq_q, seq_k, device=q.device), float("-inf"))
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)  # every key masked: output 0, not NaN
    s = s.masked_fill(dead, 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    if dropout_p > 0.0:
        keep = dropout_keep(seed, dropout_p, batch, heads, seq_q, seq_k, device=q.device)
        p = p.masked_fill(~keep, 0.0) * (1.0 / (1.0 - dropout_p))
    return (p.to(work) @ vw).to(q.dtype)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    key_padding_bias: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | torch.Tensor | None = None,
    softmax_scale: float | None = None, deterministic: bool = True, backend: str | None = None,
) -> torch.Tensor:
    """The oracle: materialized scores, softmax and both matmuls in fp32 (fp64 for fp64 inputs),
    output cast to q's dtype.

    Same signature as :func:`tachyon.kernels.attention.attention` (``deterministic`` and
    ``backend`` are accepted and ignored: this is always plain, deterministic PyTorch). Autograd
    differentiates it and saves what autograd saves, the [batch, heads, seq_q, seq_k]
    probabilities included: use it for tests, not training.
    """
    del backend, deterministic
    return _attention_math(q, k, v, causal, key_padding_bias, dropout_p, seed, softmax_scale, upcast=True)


def attention_lowp_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    key_padding_bias: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | torch.Tensor | None = None,
    softmax_scale: float | None = None, deterministic: bool = True, backend: str | None = None,
) -> torch.Tensor:
    """Eager PyTorch attention in q's dtype: both matmuls in that dtype, softmax in fp32 and the
    probabilities rounded to the dtype before ``p @ v`` (what an eager fp16/bf16 model computes).
    The baseline of the "2x the error of PyTorch" rule for low-precision kernels. ``deterministic``
    and ``backend`` are ignored."""
    del backend, deterministic
    return _attention_math(q, k, v, causal, key_padding_bias, dropout_p, seed, softmax_scale, upcast=False)


# ---------------------------------------------------------------------------------------------
# The memory-efficient CPU backend: explicit forward (out, lse) and backward from (q, k, v, out, lse)
# ---------------------------------------------------------------------------------------------


def _chunks(seq_q: int, per_row: int, dropout: bool):
    budget = _CHUNK_ELEMENTS_DROPOUT if dropout else _CHUNK_ELEMENTS
    step = max(1, min(seq_q, budget // max(per_row, 1)))
    for i0 in range(0, seq_q, step):
        yield i0, min(seq_q, i0 + step)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, r, n] -> [b, kv_heads, (h // kv_heads) * r, n]: one matmul per kv head serves its group."""
    b, h, r, n = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * r, n)


def _ungrouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, kvh, gr, n = x.shape
    return x.reshape(b, heads, gr * kvh // heads, n)


def _scores(qc, kf, bias, causal, seq_q, rows):
    """fp32 scores [b, h, rows, seq_k] of a chunk qc: [b, h, rows, d] (pre-scaled by softmax_scale)
    against kf: [b, kvh, sk, d], plus the bias, -inf where causal masks."""
    heads, kv_heads = qc.shape[1], kf.shape[1]
    s = _ungrouped(_grouped(qc, kv_heads) @ kf.transpose(-1, -2), heads)
    if bias is not None:
        s.add_(bias[:, None, None, :])
    if causal:
        s.masked_fill_(~causal_allowed(seq_q, kf.shape[2], rows, device=qc.device), float("-inf"))
    return s


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_bias: torch.Tensor | None,
    causal: bool, dropout_p: float, seed: int, softmax_scale: float, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the CPU backend. Returns (out [b, h, sq, d] in q's dtype: ``out`` when given
    (any strides), else contiguous; lse [b, h, sq] fp32, +inf on fully masked rows so that
    recomputed probabilities are 0 there).

    key_padding_bias: None or fp32 [b, sk]. Nothing of size seq_q * seq_k outlives a chunk.
    """
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    kf, vf = k.float(), v.float()
    bias = key_padding_bias.float() if key_padding_bias is not None else None
    if out is None:
        out = torch.empty((batch, heads, seq_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    dropout = dropout_p > 0.0
    may_have_empty_rows = bias is not None or (causal and seq_q > seq_k)
    for i0, i1 in _chunks(seq_q, batch * heads * seq_k, dropout):
        s = _scores(q[:, :, i0:i1].float() * softmax_scale, kf, bias, causal, seq_q, (i0, i1))
        lse_c = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        del s
        if may_have_empty_rows:  # every key masked: softmax gave NaN, lse -inf; make them 0 and +inf
            empty = torch.isneginf(lse_c)
            p.masked_fill_(empty[..., None], 0.0)
            lse_c.masked_fill_(empty, math.inf)
        lse[:, :, i0:i1] = lse_c
        if dropout:
            keep = dropout_keep(seed, dropout_p, batch, heads, seq_q, seq_k, (i0, i1), q.device)
            p.masked_fill_(~keep, 0.0).mul_(1.0 / (1.0 - dropout_p))
        out[:, :, i0:i1] = _ungrouped(_grouped(p, kv_heads) @ vf, heads).to(q.dtype)
    return out, lse


def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, key_padding_bias: torch.Tensor | None, causal: bool, dropout_p: float,
    seed: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the CPU backend from what the forward kept. Returns (dq, dk, dv), contiguous,
    in the dtypes of q, k, v. With P = exp(S - lse), Z = keep / (1 - p), D = rowsum(dO * O):

        dV = (P*Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - D),   dQ = scale dS K,   dK = scale dS^T Q

    (rowsum(dP * P) = D because O = (P*Z) V.) GQA groups are summed by the grouped matmuls.
    """
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    kf, vf = k.float(), v.float()
    bias = key_padding_bias.float() if key_padding_bias is not None else None
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    dropout = dropout_p > 0.0
    for i0, i1 in _chunks(seq_q, batch * heads * seq_k, dropout):
        qc = q[:, :, i0:i1].float()
        doc = dout[:, :, i0:i1].float()
        delta = (doc * out[:, :, i0:i1].float()).sum(dim=-1, keepdim=True)
        s = _scores(qc * softmax_scale, kf, bias, causal, seq_q, (i0, i1))
        p = torch.exp_(s.sub_(lse[:, :, i0:i1, None]))  # lse = +inf on dead rows: p = 0
        dp = _ungrouped(_grouped(doc, kv_heads) @ vf.transpose(-1, -2), heads)
        if dropout:
            keep = dropout_keep(seed, dropout_p, batch, heads, seq_q, seq_k, (i0, i1), q.device)
            inv_keep = 1.0 / (1.0 - dropout_p)
            pd = p.masked_fill(~keep, 0.0).mul_(inv_keep)
            dp.masked_fill_(~keep, 0.0).mul_(inv_keep)
        else:
            pd = p
        dv += _grouped(pd, kv_heads).transpose(-1, -2) @ _grouped(doc, kv_heads)
        ds = p.mul_(dp.sub_(delta))
        ds_g = _grouped(ds, kv_heads)
        dq[:, :, i0:i1] = _ungrouped(ds_g @ kf, heads).mul_(softmax_scale).to(q.dtype)
        dk += ds_g.transpose(-1, -2) @ _grouped(qc, kv_heads)
    return dq, dk.mul_(softmax_scale).to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Masks and torch SDPA
# ---------------------------------------------------------------------------------------------


def padding_bias_from_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A key padding mask in any of the usual forms -> the additive [batch, seq] bias (default fp32).

    - [batch, seq] bool or 0/1 (HF's ``attention_mask``): True / nonzero = keep -> 0, else -inf.
    - [batch, 1, 1, seq] additive (HF's extended mask, 0 = keep, finfo.min or -inf = masked):
      values at or below MASKED_BIAS become -inf, other values are kept as they are (e.g. an
      old-style -10000 stays -10000).
    - [batch, 1, 1, seq] bool (True = keep), as HF's SDPA path builds it.

    Because masked keys become -inf, a row with no key left gives zeros (out and gradients), where
    HF's finfo.min gives the uniform average of all values. Other shapes raise ValueError.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"padding_bias_from_mask: mask must be a tensor; got {type(mask).__name__}")
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask2 = mask[:, 0, 0, :]
        if mask2.dtype == torch.bool:
            return _bias_from_keep(mask2, dtype)
        if not mask2.is_floating_point():
            raise ValueError(f"padding_bias_from_mask: an additive [batch, 1, 1, seq] mask must be float; got {mask.dtype}")
        return masked_bias(mask2).to(dtype)
    if mask.dim() == 2:
        return _bias_from_keep(mask != 0, dtype)
    raise ValueError(
        f"padding_bias_from_mask: mask has shape {tuple(mask.shape)}; allowed: [batch, seq] (bool or 0/1, "
        "True/1 = keep) or HF's [batch, 1, 1, seq] (additive, or bool). Masks that differ per query "
        "(e.g. [batch, 1, seq_q, seq_k]) are not key padding masks"
    )


def _bias_from_keep(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.full((), float("-inf"), dtype=dtype, device=keep.device))


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    key_padding_bias: torch.Tensor | None = None, softmax_scale: float | None = None,
) -> torch.Tensor:
    """The same attention (no dropout) through torch.nn.functional.scaled_dot_product_attention.

    Without a bias and with causal only for seq_q == seq_k the call carries no mask, so torch may
    pick its flash kernel; otherwise an additive [b, 1, sq, sk] mask is built (bottom-right causal).
    Fully masked rows: whatever torch's chosen backend does (not necessarily zeros).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    seq_q, seq_k = q.shape[2], k.shape[2]
    scale = default_scale(q.shape[-1], softmax_scale)
    mask = None
    is_causal = causal and key_padding_bias is None and seq_q == seq_k
    if (causal and not is_causal) or key_padding_bias is not None:
        mask = torch.zeros((q.shape[0], 1, seq_q, seq_k), dtype=q.dtype, device=q.device)
        if key_padding_bias is not None:
            mask = mask + masked_bias(key_padding_bias).to(q.dtype)[:, None, None, :]
        if causal:
            mask = mask.masked_fill(~causal_allowed(seq_q, seq_k, device=q.device), float("-inf"))
    if heads != kv_heads:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                                  enable_gqa=True)
        except TypeError:  # torch < 2.5 has no enable_gqa
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
