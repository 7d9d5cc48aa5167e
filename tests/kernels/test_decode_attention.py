"""Attention over a KV cache: the Triton kernel (interpreted on CPU, native on GPU) and the torch
path against the fp64 reference and against the flash-attention op on the same keys; GQA/MQA,
odd head dims, ragged cache lengths, padding slots, sliding windows, split-K; bad input."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.attention import attention_reference
from tachyon.kernels.decode_attention import decode_attention, decode_attention_reference, visible_keys
from tests.utils import assert_close, assert_close_to_reference

GPU = [pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.float16, torch.bfloat16)]
CPU = [("cpu", torch.float32), ("cpu", torch.float16)]
# (batch, heads, kv_heads, seq_q, head_dim, capacity, lengths, window, padded, splits)
CASES = [
    (2, 4, 2, 1, 16, 40, (5, 33), None, False, None),      # decode, GQA, ragged lengths
    (2, 4, 2, 1, 16, 40, (5, 33), None, True, 3),          # split-K over the cache, padding slots
    (1, 3, 1, 1, 24, 20, (20,), None, False, 2),            # MQA, non-power-of-2 head dim, full cache
    (2, 4, 4, 5, 16, 24, (9, 24), 4, True, None),           # several queries, sliding window
    (1, 2, 2, 7, 20, 7, (7,), None, True, None),            # a whole prompt (prefill) with left padding
]


def _inputs(case, dtype, device, seed=0):
    b, h, hk, sq, d, cap, lengths, window, padded, splits = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g).to(device, dtype)
    k = torch.randn(b, hk, cap, d, generator=g).to(device, dtype)
    v = torch.randn(b, hk, cap, d, generator=g).to(device, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    bias = None
    if padded:  # the first two slots of sequence 0 are padding
        bias = torch.zeros(b, cap, device=device)
        bias[0, :2] = float("-inf")
    return q, k, v, lens, bias, window, splits


@pytest.mark.parametrize("device,dtype", CPU + GPU)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_fp64_reference(device, dtype, backend, case):
    q, k, v, lens, bias, window, splits = _inputs(case, dtype, device)
    out = decode_attention(q, k, v, lens, key_padding_bias=bias, window=window, num_splits=splits, backend=backend)
    oracle = decode_attention_reference(q.double(), k.double(), v.double(), lens, key_padding_bias=bias, window=window)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        assert_close(out, oracle.float(), name="out")
    else:  # low precision: within 2x of plain PyTorch attention in the same dtype
        assert_close_to_reference(out, _eager_lowp(q, k, v, lens, bias, window), oracle, name="out")


def _eager_lowp(q, k, v, lens, bias, window):
    """Eager attention as a model in q's dtype computes it: both matmuls in that dtype, the
    softmax in fp32, the probabilities rounded to the dtype."""
    b, h, sq, d = q.shape
    group = h // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kk.transpose(-1, -2)).float() * d ** -0.5
    if bias is not None:
        s = s + bias[:, None, None, :]
    s = s.masked_fill(~visible_keys(lens, sq, k.shape[2], window)[:, None], float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return p.to(q.dtype) @ vv


def test_decode_equals_the_last_row_of_causal_attention():
    """One query at the end of a full cache is the last row of ordinary causal attention."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 16, generator=g)
    k, v = torch.randn(2, 2, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)
    full = attention_reference(q, k, v, causal=True)
    lens = torch.full((2,), 6, dtype=torch.int32)
    for backend in ("triton", "torch"):
        out = decode_attention(q[:, :, -1:], k, v, lens, backend=backend)
        assert_close(out, full[:, :, -1:], name=f"{backend} decode vs causal attention")


def test_rows_with_no_visible_key_are_zero():
    q, k, v, lens, bias, window, splits = _inputs(CASES[4], torch.float32, "cpu")
    for backend in ("triton", "torch"):
        out = decode_attention(q, k, v, lens, key_padding_bias=bias, backend=backend)
        assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2])), f"{backend}: padded query rows must be 0"
        assert torch.isfinite(out).all()


def test_splits_do_not_change_the_result():
    q, k, v, lens, bias, window, _ = _inputs(CASES[1], torch.float32, "cpu")
    one = decode_attention(q, k, v, lens, key_padding_bias=bias, num_splits=1, backend="triton")
    for splits in (2, 3):
        many = decode_attention(q, k, v, lens, key_padding_bias=bias, num_splits=splits, backend="triton")
        assert_close(many, one, name=f"{splits} splits vs 1")


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(2, 4, 1)), "4-d tensor"),
    (dict(k=torch.zeros(2, 3, 10, 16), v=torch.zeros(2, 3, 10, 16)), "multiple of kv_heads"),
    (dict(lens=torch.zeros(2)), "int32/int64"),
    (dict(lens=torch.zeros(3, dtype=torch.int32)), r"\[batch=2\]"),
    (dict(bias=torch.zeros(2, 5)), "key_padding_bias"),
    (dict(window=0), "window"),
    (dict(k=torch.zeros(2, 2, 10, 16, dtype=torch.float16)), "share one dtype"),
    (dict(q=torch.zeros(2, 4, 11, 16)), "do not fit"),
])
def test_bad_input_is_refused(bad, match):
    args = dict(q=torch.zeros(2, 4, 1, 16), k=torch.zeros(2, 2, 10, 16), v=torch.zeros(2, 2, 10, 16),
                lens=torch.ones(2, dtype=torch.int32), bias=None, window=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        decode_attention(args["q"], args["k"], args["v"], args["lens"], key_padding_bias=args["bias"],
                         window=args["window"])


def test_refuses_tensors_that_need_grad():
    q = torch.zeros(1, 2, 1, 16, requires_grad=True)
    with pytest.raises(ValueError, match="no backward"):
        decode_attention(q, torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), torch.ones(1, dtype=torch.int32))


def test_compiles_as_one_custom_op():
    q, k, v, lens, bias, window, splits = _inputs(CASES[0], torch.float32, "cpu")
    fn = torch.compile(lambda *a: decode_attention(*a, backend="torch"), backend="aot_eager", fullgraph=True)
    assert_close(fn(q, k, v, lens), decode_attention(q, k, v, lens, backend="torch"), name="compiled")
