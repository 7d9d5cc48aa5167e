"""traffic_minimum: the ideal program's bytes and launches, checked by hand on small shapes."""

from __future__ import annotations

import pytest
import torch

from tachyon.profiling.traffic_minimum import adam_minimum, bert_layer_minimum, transformer_layer_minimum


def test_bert_gemms_are_their_operands_and_the_flags_cost_what_they_recompute():
    t, h, i, heads, e = 8, 16, 64, 2, 4
    m = bert_layer_minimum(1, t, h, i, heads)
    gemms = {s.name: s.read + s.written for s in m.steps if "GEMM" in s.name}
    assert len(gemms) == 12 and m.launches == 18  # 12 GEMMs, 2 attention, 4 elementwise passes
    assert gemms["QKV GEMM"] == (t * h + 3 * h * h + 3 * h + 3 * t * h) * e
    assert gemms["output dW GEMM"] == (t * h + t * i + h * i) * e
    assert gemms["QKV dX GEMM"] == (3 * t * h + 3 * h * h + t * h + t * h) * e  # accumulates the residual's gradient
    # the GELU in the epilogues: forward writes pre and GELU(pre); backward reads pre, writes dpre and dbias
    assert gemms["intermediate GEMM + bias + GELU"] == (t * h + h * i + i + 2 * t * i) * e
    assert gemms["output dX GEMM + GELU backward"] == (t * h + h * i + t * i + t * i + i) * e
    base = m.bytes
    assert bert_layer_minimum(1, t, h, i, heads, gelu_checkpoint=True).bytes == base + 2 * t * i * e
    # invertible: z1, z2 not written, not read (y read instead), one fp32 statistic per row less
    assert bert_layer_minimum(1, t, h, i, heads, normalize_invertible=True).bytes == base - 2 * t * h * e - 4 * t * 4
    assert bert_layer_minimum(1, t, h, i, heads, attn_dropout_checkpoint=True).launches == 20
    assert bert_layer_minimum(1, t, h, i, heads, torch.bfloat16, backward=False).launches == 7


def test_transformer_layer_and_adam():
    gpt = transformer_layer_minimum(1, 8, 16, 64, 2)
    llama = transformer_layer_minimum(1, 8, 16, 44, 2, 1, normalization="RMSNorm", gated=True, bias=False,
                                      dropout=False)
    assert gpt.launches == 20 and llama.launches == 19  # no dropout, no bias: out's gradient is fc2's
    adam = adam_minimum([10, 6], torch.bfloat16, torch.float32)
    assert (adam.steps[0].read, adam.steps[0].written, adam.launches) == (16 * (2 + 4 + 8), 16 * (2 + 8), 1)
    assert "total" in gpt.table()


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="seq must be an int >= 1; got 0"):
        bert_layer_minimum(1, 0, 16, 64, 2)
    with pytest.raises(ValueError, match="hidden=15 is not a multiple of heads=2"):
        bert_layer_minimum(1, 8, 15, 64, 2)
    with pytest.raises(ValueError, match="normalization='BatchNorm'; allowed: 'LayerNorm', 'RMSNorm'"):
        transformer_layer_minimum(1, 8, 16, 64, 2, normalization="BatchNorm")
    with pytest.raises(ValueError, match="heads a multiple of kv_heads=3"):
        transformer_layer_minimum(1, 8, 16, 64, 4, 3)
    with pytest.raises(ValueError, match="numels must be a non-empty list"):
        adam_minimum([])
