"""Fused QKV split + RoPE at per-token positions + KV-cache append: the Triton kernel (interpreted
on CPU, native on GPU) and the torch path against HF's rotary formulas (Llama's rotate-half,
GPT-J's interleaved pairs, partial rotary), cache slots at ragged lengths, bad input."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.kv_append import rotary_kv_append
from tachyon.kernels.rope import rope_frequencies
from tests.utils import assert_close

GPU = [pytest.param("cuda", dt, marks=pytest.mark.gpu) for dt in (torch.float32, torch.float16, torch.bfloat16)]
CPU = [("cpu", torch.float32), ("cpu", torch.float16)]


def _hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf_rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _expected(qkv, positions, h, hk, d, r, interleaved):
    """HF's own formulas (LlamaAttention's apply_rotary_pos_emb, GPT-J's rotate_every_two), fp64."""
    b, s, _ = qkv.shape
    parts = qkv.double().view(b, s, h + 2 * hk, d)
    q, k, v = parts[:, :, :h], parts[:, :, h:h + hk], parts[:, :, h + hk:]
    if r is None:
        return q, k, v
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    ang = positions.double()[..., None] * inv_freq
    if interleaved:
        cos, sin, rot = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1), _hf_rotate_every_two
    else:
        cos, sin, rot = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin(), _hf_rotate_half

    def apply(x):
        xr = x[..., :r] * cos[:, :, None] + rot(x[..., :r]) * sin[:, :, None]
        return torch.cat([xr, x[..., r:]], -1)

    return apply(q), apply(k), v


# (heads, kv_heads, head_dim, rotary_dim or None, interleaved)
CASES = [(4, 2, 16, 16, False), (4, 2, 16, 8, True), (3, 1, 24, 12, False), (2, 2, 20, None, False)]


@pytest.mark.parametrize("device,dtype", CPU + GPU)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_hf_rotary_and_writes_the_right_slots(device, dtype, backend, case):
    h, hk, d, r, interleaved = case
    b, s, cap = 2, 3, 12
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, s, (h + 2 * hk) * d, generator=g).to(device, dtype)
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]], device=device)  # row 1: shifted by left padding
    lengths = torch.tensor([0, 4], dtype=torch.int32, device=device)
    cos, sin = rope_frequencies(16, r, device=device, interleaved=interleaved) if r else (None, None)
    kc = torch.full((b, hk, cap, d), 7.0, device=device, dtype=dtype)
    vc = kc.clone()
    q = rotary_kv_append(qkv, positions, cos, sin, kc, vc, lengths, heads=h, kv_heads=hk, interleaved=interleaved,
                         backend=backend)
    eq, ek, ev = _expected(qkv.cpu(), positions.cpu(), h, hk, d, r, interleaved)
    tol = torch.float32 if dtype == torch.float32 else dtype
    assert_close(q.cpu(), eq.transpose(1, 2).to(dtype), dtype=tol, name="q")
    for row, start in enumerate((0, 4)):
        assert_close(kc[row, :, start:start + s].cpu(), ek[row].transpose(0, 1).to(dtype), dtype=tol, name="k slots")
        assert_close(vc[row, :, start:start + s].cpu(), ev[row].transpose(0, 1).to(dtype), dtype=tol, name="v slots")
        untouched = torch.ones(cap, dtype=torch.bool)
        untouched[start:start + s] = False
        assert bool((kc[row, :, untouched] == 7).all()) and bool((vc[row, :, untouched] == 7).all()), \
            "slots outside [length, length + s) must not be written"


def test_backends_agree_bit_for_bit_in_fp32():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 4, 8 * 16, generator=g)
    positions = torch.randint(0, 30, (2, 4), generator=g)
    cos, sin = rope_frequencies(32, 16)
    outs = []
    for backend in ("triton", "torch"):
        kc, vc = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
        q = rotary_kv_append(qkv, positions, cos, sin, kc, vc, torch.tensor([1, 3], dtype=torch.int32),
                             heads=4, kv_heads=2, backend=backend)
        outs.append((q, kc, vc))
    for a, b in zip(*outs):
        assert_close(a, b, name="triton vs torch")


@pytest.mark.parametrize("bad,match", [
    (dict(qkv=torch.zeros(2, 3, 100)), "last dim"),
    (dict(positions=torch.zeros(2, 3)), "int32/int64"),
    (dict(lengths=torch.zeros(5, dtype=torch.int32)), "cache_lengths"),
    (dict(cos=None), "both cos and sin"),
    (dict(cos=torch.zeros(16, 18), sin=torch.zeros(16, 18)), "rotary_dim"),
    (dict(kc=torch.zeros(2, 2, 8, 16, dtype=torch.float16)), "dtype"),
    (dict(qkv=torch.zeros(2, 9, 128)), "do not fit"),
])
def test_bad_input_is_refused(bad, match):
    cos, sin = rope_frequencies(16, 16)
    args = dict(qkv=torch.zeros(2, 3, 128), positions=torch.zeros(2, 3, dtype=torch.long), cos=cos, sin=sin,
                kc=torch.zeros(2, 2, 8, 16), vc=torch.zeros(2, 2, 8, 16), lengths=torch.zeros(2, dtype=torch.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rotary_kv_append(args["qkv"], args["positions"], args["cos"], args["sin"], args["kc"], args["vc"],
                         args["lengths"], heads=4, kv_heads=2)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_q_in_place_is_a_view_of_qkv_and_the_cache_is_unchanged(backend):
    """Without rotary, q_in_place returns qkv's q heads as a view (nothing copied) and writes the
    same cache slots as the copying call."""
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16, generator=g)
    positions = torch.zeros(2, 3, dtype=torch.long)
    lengths = torch.tensor([0, 2], dtype=torch.int32)
    caches = []
    for in_place in (False, True):
        kc, vc = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
        q = rotary_kv_append(qkv, positions, None, None, kc, vc, lengths, heads=4, kv_heads=2, q_in_place=in_place,
                             backend=backend)
        caches.append((q, kc, vc))
    (q_copy, kc0, vc0), (q_view, kc1, vc1) = caches
    assert q_view.shape == q_copy.shape == (2, 4, 3, 16)
    assert q_view.data_ptr() == qkv.data_ptr() and q_view.stride(-1) == 1, "q must be a view of qkv"
    assert torch.equal(q_view, q_copy) and torch.equal(kc0, kc1) and torch.equal(vc0, vc1)
    with pytest.raises(ValueError, match="only without rotary"):
        cos, sin = rope_frequencies(16, 16)
        rotary_kv_append(qkv, positions, cos, sin, kc0, vc0, lengths, heads=4, kv_heads=2, q_in_place=True)
