"""The flops profiler's counts against analytic formulas, forward and backward: Linear, attention
(causal and not, torch's CPU flash kernel and tachyon's op, Sq != Sk alignments), HF BertLayer and
GPT2Block, tachyon's TransformerKernelLayer and TransformerLayer. The formulas are written here
from the shapes, independently of the profiler (rules: tachyon/profiling/counting.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tachyon.kernels.attention import attention
from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer, TransformerLayer
from tachyon.profiling import FlopsProfiler, get_model_profile
from tachyon.profiling.counting import attention_pairs

B, S, H, I, HEADS = 2, 7, 32, 48, 4
D = H // HEADS
LN = 5  # FLOPs per element of an affine LayerNorm (DeepSpeed's rule)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def profile(module: nn.Module, *args, backward: bool = False, **kwargs) -> FlopsProfiler:
    prof = FlopsProfiler(module, count_backward=backward)
    prof.start_profile()
    try:
        out = module(*args, **kwargs)
        if backward:
            (out[0] if isinstance(out, tuple) else out).backward(torch.ones_like(out[0] if isinstance(out, tuple) else out))
    finally:
        prof.stop_profile()
    return prof


def test_linear_forward_and_backward():
    layer = nn.Linear(H, I)
    x = torch.randn(B, S, H, requires_grad=True)
    prof = profile(layer, x, backward=True)
    gemm = B * S * H * I
    assert prof.get_total_flops() == 2 * gemm and prof.get_total_macs() == gemm
    # backward: dX and dW GEMMs, plus the bias gradient (a sum over the B * S rows)
    assert prof.get_total_backward_flops() == 4 * gemm + B * S * I
    assert prof.get_total_backward_macs() == 2 * gemm
    assert prof.get_total_params() == H * I + I
    no_bias = profile(nn.Linear(H, I, bias=False), x)
    assert no_bias.get_total_flops() == 2 * gemm  # a bias inside the GEMM is not counted


class SDPA(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _pairs_top_left(sq: int, sk: int) -> int:
    return sum(min(i + 1, sk) for i in range(sq))


def _pairs_bottom_right(sq: int, sk: int) -> int:
    return sum(max(0, min(i + 1 + sk - sq, sk)) for i in range(sq))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(S, S), (5, 9), (9, 5)])
def test_sdpa_on_the_cpu_flash_path(causal, seq_q, seq_k):
    q = torch.randn(B, HEADS, seq_q, D, requires_grad=True)
    k = torch.randn(B, HEADS, seq_k, D, requires_grad=True)
    v = torch.randn(B, HEADS, seq_k, D, requires_grad=True)
    prof = profile(SDPA(causal), q, k, v, backward=True)
    pairs = _pairs_top_left(seq_q, seq_k) if causal else seq_q * seq_k  # torch's is_causal: top-left
    assert ("aten._scaled_dot_product_flash_attention_for_cpu", "fwd") in prof.op_flops
    assert prof.get_total_flops() == 4 * B * HEADS * pairs * D  # QK^T and PV
    assert prof.get_total_macs() == 2 * B * HEADS * pairs * D
    assert prof.get_total_backward_flops() == 10 * B * HEADS * pairs * D  # recompute, dP, dV, dQ, dK
    if causal and seq_q == seq_k:
        assert pairs == S * (S + 1) // 2


class TachyonAttention(nn.Module):
    def forward(self, q, k, v, causal):
        return attention(q, k, v, causal=causal, backend="torch")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q,seq_k", [(S, S), (5, 9), (9, 5)])
def test_tachyon_attention_op_counts_bottom_right_causal_pairs(causal, seq_q, seq_k):
    q = torch.randn(B, HEADS, seq_q, D, requires_grad=True)
    k = torch.randn(B, 2, seq_k, D, requires_grad=True)  # GQA: 2 kv heads
    v = torch.randn(B, 2, seq_k, D, requires_grad=True)
    prof = profile(TachyonAttention(), q, k, v, causal, backward=True)
    pairs = _pairs_bottom_right(seq_q, seq_k) if causal else seq_q * seq_k
    assert attention_pairs(seq_q, seq_k, causal, bottom_right=True) == pairs
    assert dict(prof.op_flops) == {("tachyon.attention_fwd", "fwd"): 4 * B * HEADS * pairs * D,
                                   ("tachyon.attention_bwd", "bwd"): 10 * B * HEADS * pairs * D}


def _expected_bert(b: int, s: int) -> tuple[int, int]:
    """(FLOPs, MACs) of one BERT layer's forward, no mask, dropout off."""
    gemm_macs = 4 * b * s * H * H + 2 * b * s * H * I  # Q, K, V, attention output; intermediate, output
    attn_macs = 2 * b * s * s * H  # QK^T and PV over all heads
    elementwise = 2 * LN * b * s * H + b * s * I + 2 * b * s * H  # 2 LayerNorms, GELU, 2 residual adds
    return 2 * (gemm_macs + attn_macs) + elementwise, gemm_macs + attn_macs


def test_hf_bert_layer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    config = transformers.BertConfig(hidden_size=H, intermediate_size=I, num_attention_heads=HEADS,
                                     attn_implementation="sdpa")
    layer = BertLayer(config).eval()
    flops, macs, params = get_model_profile(layer, args=[torch.randn(B, S, H)], print_profile=False, as_string=False)
    assert (flops, macs) == _expected_bert(B, S)
    assert params == sum(p.numel() for p in layer.parameters())


def test_hf_gpt2_block_with_causal_attention():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(n_embd=H, n_head=HEADS, attn_implementation="sdpa")
    block = GPT2Block(config, layer_idx=0).eval()
    flops, macs, _ = get_model_profile(block, args=[torch.randn(B, S, H)], print_profile=False, as_string=False)
    n, ffn = B * S, 4 * H
    gemm_macs = n * H * 3 * H + n * H * H + 2 * n * H * ffn  # c_attn, c_proj, mlp.c_fc, mlp.c_proj
    attn_macs = 2 * B * HEADS * (S * (S + 1) // 2) * D  # causal: only the lower triangle
    # gelu_new is written as 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))): 8 ops per element
    elementwise = 2 * LN * n * H + 8 * n * ffn + 2 * n * H
    assert (flops, macs) == (2 * (gemm_macs + attn_macs) + elementwise, gemm_macs + attn_macs)


def _kernel_config(**kw) -> TransformerKernelConfig:
    return TransformerKernelConfig(batch_size=B, max_seq_length=S, hidden_size=H, intermediate_size=I, heads=HEADS,
                                   attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                   initializer_range=0.02, seed=1, **kw)


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_tachyon_transformer_kernel_layer(pre_ln):
    layer = TransformerKernelLayer(_kernel_config(pre_layer_norm=pre_ln), backend="torch")
    n = B * S
    gemm_macs = n * H * 3 * H + n * H * H + 2 * n * H * I  # QKV, Wo, Wi, Wout
    attn_macs = 2 * B * S * S * H
    # bias + residual on both branches, GELU + its bias, 2 LayerNorms (pre-LN: input LN, LN before the FFN)
    elementwise = 4 * n * H + 2 * n * I + 2 * LN * n * H
    layer.eval()  # no dropout
    prof = profile(layer, torch.randn(B, S, H))
    assert (prof.get_total_flops(), prof.get_total_macs()) == (2 * (gemm_macs + attn_macs) + elementwise,
                                                               gemm_macs + attn_macs)
    layer.train()  # the two hidden dropouts add one multiply per element each
    prof = profile(layer, torch.randn(B, S, H))
    assert prof.get_total_flops() == 2 * (gemm_macs + attn_macs) + elementwise + 2 * n * H


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_tachyon_transformer_layer_gpt_style(activation):
    layer = TransformerLayer(H, I, HEADS, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
                             activation=activation)
    x = torch.randn(B, S, H, requires_grad=True)
    prof = profile(layer, x, backward=True)
    n, gated = B * S, activation == "swiglu"
    fc1_out = 2 * I if gated else I
    gemm_macs = n * H * 3 * H + n * H * H + n * H * fc1_out + n * I * H  # QKV, proj, fc1, fc2
    attn_macs = 2 * B * HEADS * (S * (S + 1) // 2) * D  # causal (TE's default mask)
    act = n * fc1_out + n * I * (2 if gated else 1)  # fc1 bias, activation (+ gate multiply)
    elementwise = 2 * LN * n * H + act + 2 * 2 * n * H  # 2 norms, activation, 2 x (bias + residual)
    assert prof.get_total_flops() == 2 * (gemm_macs + attn_macs) + elementwise
    assert prof.get_total_macs() == gemm_macs + attn_macs
    # backward GEMMs: every forward GEMM twice (input and weight gradients); attention 2.5x forward
    assert prof.get_total_backward_macs() == 2 * gemm_macs + attn_macs * 5 // 2


class Rope(nn.Module):
    def forward(self, q, k, cos, sin):
        from tachyon.kernels.rope import apply_rotary

        return apply_rotary(q, k, cos, sin, backend="torch")


def test_tachyon_rope_and_fp8_cast():
    from tachyon.kernels.fp8_cast import cast_to_fp8
    from tachyon.kernels.rope import rope_frequencies

    rotary = 6  # of head_dim 8: the last 2 dims pass through
    cos, sin = rope_frequencies(S, rotary)
    q = torch.randn(B, S, HEADS, D, requires_grad=True)
    k = torch.randn(B, S, 2, D, requires_grad=True)
    prof = profile(Rope(), q, k, cos, sin, backward=True)
    rotated = B * S * (HEADS + 2) * rotary
    assert dict(prof.op_flops) == {("tachyon.rotary", "fwd"): 3 * rotated, ("tachyon.rotary", "bwd"): 3 * rotated}

    class Cast(nn.Module):
        def forward(self, x, amax):
            return cast_to_fp8(x, torch.tensor(2.0), torch.float8_e4m3fn, amax, backend="torch")

    x = torch.randn(5, 12)
    assert profile(Cast(), x, None).get_total_flops() == x.numel()  # the scale multiply
    assert profile(Cast(), x, torch.zeros(())).get_total_flops() == 2 * x.numel()  # and the |x| max


def test_int8_gemms_count_their_gemm_norm_and_epilogue():
    """INT8 inference GEMMs: 2 M N K FLOPs (M N K MACs) as any GEMM, + bias and activation per
    output (a gated one: the activation and the gate multiply per output), + the prologue's norm
    (5 per element, + 1 for the residual add)."""
    from tachyon.kernels.int8_linear import int8_linear, norm_int8_linear, quantize_symmetric

    class Int8(nn.Module):
        def forward(self, x, activation):
            return int8_linear(x, q, s, bias, activation=activation, backend="torch")

    class NormInt8(nn.Module):
        def forward(self, x, residual):
            return norm_int8_linear(x, torch.ones(12), torch.zeros(12), q, s, bias, residual=residual,
                                    backend="torch")[0]

    q, s = quantize_symmetric(torch.randn(8, 12))
    bias, x = torch.randn(8), torch.randn(5, 12)
    gemm = 5 * 8 * 12
    with torch.no_grad():
        assert (profile(Int8(), x, None).get_total_flops(), profile(Int8(), x, None).get_total_macs()) == (
            2 * gemm + 5 * 8, gemm)
        assert profile(Int8(), x, "gelu").get_total_flops() == 2 * gemm + 2 * 5 * 8
        assert profile(Int8(), x, "swiglu").get_total_flops() == 2 * gemm + 5 * 8 + 2 * 5 * 4
        assert profile(NormInt8(), x, x).get_total_flops() == 2 * gemm + 5 * 8 + LN * 5 * 12 + 5 * 12


def test_every_tachyon_op_of_a_training_step_is_counted():
    """Kernel layer and TransformerLayer (RoPE, dropout on) forward + backward: each tachyon op that
    runs gets a nonzero count, and the dropout / norm backward ops their formulas."""
    from tachyon.nn import RotaryPositionEmbedding

    kernel = TransformerKernelLayer(_kernel_config(), backend="torch").train()
    prof = profile(kernel, torch.randn(B, S, H, requires_grad=True), backward=True)
    n = B * S * H
    counted = dict(prof.op_flops)
    assert counted[("tachyon.dropout_bwd", "bwd")] == 2 * n + n  # FFN-output dropout's backward + bias gradient
    # attention-output branch: LayerNorm backward (2 x 5 per element) + dropout backward (2 per element)
    assert counted[("tachyon.bias_dropout_add_norm_bwd", "bwd")] == 2 * LN * n + 2 * n + n  # + bias gradient sum
    layer = TransformerLayer(H, I, HEADS, hidden_dropout=0.1, attention_dropout=0.1, attn_input_format="bshd")
    rope = RotaryPositionEmbedding(D)(S)
    prof_layer = profile(layer, torch.randn(B, S, H, requires_grad=True), rotary_pos_emb=rope, backward=True)
    seen = {op for op, _ in prof.op_flops} | {op for op, _ in prof_layer.op_flops}
    expected = {"tachyon.norm_fwd", "tachyon.norm_bwd", "tachyon.attention_packed_fwd", "tachyon.attention_packed_bwd",
                "tachyon.bias_dropout_add_fwd", "tachyon.dropout_bwd", "tachyon.bias_dropout_add_norm_fwd",
                "tachyon.bias_dropout_add_norm_bwd", "tachyon.gemm_bias_act", "tachyon.gemm_act_grad"}
    assert expected <= seen, f"not counted: {sorted(expected - seen)}"
    assert all(flops > 0 for (op, _), flops in {**prof.op_flops, **prof_layer.op_flops}.items())
