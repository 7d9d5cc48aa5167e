"""TransformerLayer against a torch.nn.functional reference with shared weights (forward and every
gradient; fp32 by the table, bf16 by the 2x-of-PyTorch rule), against HF GPT2Block and
LlamaDecoderLayer (weights via from_hf), inside HF models through HFLayerAdapter, under FP8
autocast, and on the Triton path under the interpreter."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import tachyon
from tachyon.nn import RotaryPositionEmbedding, TransformerLayer
from tachyon.nn.rope import RotaryTables
from tachyon.nn.transformer_layer import HFLayerAdapter, hf_key_padding
from tests.nn.test_attention_modules import (
    CrossCall, _norm, compare_module, padding_mask, ref_cross_context, ref_mha_context, ref_rope_tables,
)
from tests.utils import assert_close

ACTS = {
    "gelu": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "qgelu": lambda h: h * torch.sigmoid(1.702 * h),
    "swiglu": lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1],
    "geglu": lambda h: F.gelu(h.chunk(2, -1)[0], approximate="tanh") * h.chunk(2, -1)[1],
}


def ref_layer(params, x, *, cfg, mask=None, mask_type="causal", rope=None, enc=None, enc_masks=None):
    """TE's TransformerLayer written with torch.nn.functional (dropout 0); decoder when enc is given."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_gqa_groups") or heads
    d = hidden // heads
    norm_type, eps = cfg.get("normalization", "LayerNorm"), cfg.get("layernorm_epsilon", 1e-5)
    zc = cfg.get("zero_centered_gamma", False)
    post_ln, out_ln = cfg.get("apply_residual_connection_post_layernorm", False), cfg.get("output_layernorm", False)
    p = dict(params)
    if zc:
        p = {n: (t + 1 if n.endswith("layer_norm_weight") or n == "layernorm.weight" else t) for n, t in p.items()}
    ctx, ln1 = ref_mha_context(p, "self_attention.", x, heads=heads, groups=groups, d=d,
                               fmt=cfg.get("attn_input_format", "sbhd"), mask_type=mask_type, mask=mask, rope=rope,
                               input_layernorm=not out_ln, normalization=norm_type, eps=eps)
    a = F.linear(ctx, p["self_attention.proj.weight"], p.get("self_attention.proj.bias"))
    h = (ln1 if post_ln and not out_ln else x) + a
    if enc is not None:
        q_masked, k_masked = (enc_masks[0][:, 0, 0], enc_masks[1][:, 0, 0]) if enc_masks is not None else (None, None)
        ctx, ln_q = ref_cross_context(p, "inter_attention.", h, enc, heads=heads, groups=groups, d=d,
                                      fmt=cfg.get("attn_input_format", "sbhd"), q_masked=q_masked, k_masked=k_masked,
                                      input_layernorm=True, normalization=norm_type, eps=eps)
        i = F.linear(ctx, p["inter_attention.proj.weight"], p.get("inter_attention.proj.bias"))
        h = (ln_q if post_ln else h) + i
    ln2 = _norm(h, p["layernorm_mlp.layer_norm_weight"], p.get("layernorm_mlp.layer_norm_bias"), norm_type, eps)
    f = ACTS[cfg.get("activation", "gelu")](F.linear(ln2, p["layernorm_mlp.fc1_weight"], p.get("layernorm_mlp.fc1_bias")))
    y = (ln2 if post_ln else h) + F.linear(f, p["layernorm_mlp.fc2_weight"], p.get("layernorm_mlp.fc2_bias"))
    if out_ln:
        y = _norm(y, p["layernorm.weight"], p.get("layernorm.bias"), norm_type, eps)
    return y


def _perturb_norms(layer):
    with torch.no_grad():
        for n, t in layer.named_parameters():
            if "layer_norm" in n or n.startswith("layernorm."):
                t.add_(0.1 * torch.randn_like(t))
            elif n.endswith("bias"):
                t.normal_(0, 0.05)


LAYER_CASES = {
    "gpt": (dict(hidden_size=96, ffn_hidden_size=160, num_attention_heads=3), "causal", 13, None),
    "llama": (dict(hidden_size=96, ffn_hidden_size=176, num_attention_heads=4, num_gqa_groups=2, normalization="RMSNorm",
                   activation="swiglu", bias=False, attn_input_format="bshd"), "causal", 37, "rope"),
    "bert_post_ln": (dict(hidden_size=120, ffn_hidden_size=128, num_attention_heads=5, output_layernorm=True,
                          apply_residual_connection_post_layernorm=True, self_attn_mask_type="padding"), "padding", 13, None),
    "post_ln_residual_mqa_relu": (dict(hidden_size=96, ffn_hidden_size=64, num_attention_heads=4, num_gqa_groups=1,
                                       apply_residual_connection_post_layernorm=True, activation="relu",
                                       self_attn_mask_type="no_mask"), "no_mask", 13, None),
    "zero_centered_rms_out_ln_qgelu": (dict(hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, normalization="RMSNorm",
                                            output_layernorm=True, zero_centered_gamma=True, activation="qgelu",
                                            attn_input_format="bshd"), "padding_causal", 13, None),
    "geglu_padding_causal": (dict(hidden_size=64, ffn_hidden_size=48, num_attention_heads=2, activation="geglu"),
                             "padding_causal", 13, "rope"),
    "silu_zero_centered": (dict(hidden_size=64, ffn_hidden_size=80, num_attention_heads=4, activation="silu",
                                zero_centered_gamma=True), "causal", 13, None),
}


def _run_case(name, dtype, device="cpu"):
    cfg, mask_type, seq, rope_kind = LAYER_CASES[name]
    layer = TransformerLayer(**cfg, hidden_dropout=0.0, attention_dropout=0.0)
    _perturb_norms(layer)
    batch = 3
    fmt = cfg.get("attn_input_format", "sbhd")
    x = torch.randn(*((seq, batch) if fmt == "sbhd" else (batch, seq)), cfg["hidden_size"])
    mask = padding_mask([seq, seq - 5, 3], seq, device) if mask_type.startswith("padding") else None
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_arg = rope_ref = None
    if rope_kind:
        rope_arg = RotaryPositionEmbedding(d, device=device)(seq)
        rope_ref = (ref_rope_tables(seq, d),) * 2

    def ref(params, xx):
        return ref_layer(params, xx, cfg=cfg, mask=mask, mask_type=mask_type, rope=rope_ref)

    compare_module(layer, ref, x, dtype, name=f"TransformerLayer[{name}]", device=device, attention_mask=mask,
                   self_attn_mask_type=mask_type, rotary_pos_emb=rope_arg)


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_transformer_layer_fp32(name):
    _run_case(name, torch.float32)


@pytest.mark.parametrize("post_ln,padded", [(False, True), (True, False)])
def test_transformer_layer_decoder(post_ln, padded):
    """layer_type="decoder": self-attention, cross-attention over encoder_output, MLP."""
    cfg = dict(hidden_size=96, ffn_hidden_size=128, num_attention_heads=4, num_gqa_groups=2, layer_type="decoder",
               apply_residual_connection_post_layernorm=post_ln)
    layer = TransformerLayer(**cfg, hidden_dropout=0.0, attention_dropout=0.0)
    _perturb_norms(layer)
    x, enc = torch.randn(13, 3, 96), torch.randn(9, 3, 96)
    enc_masks = (padding_mask([13, 6, 13], 13), padding_mask([9, 9, 3], 9)) if padded else None

    def ref(params, xx, ee):
        plain = {n.removeprefix("module."): t for n, t in params.items()}
        return ref_layer(plain, xx, cfg=cfg, enc=ee, enc_masks=enc_masks)

    compare_module(CrossCall(layer, enc_dec_attn_mask=enc_masks), ref, x, torch.float32, extra_inputs=(enc,),
                   name=f"decoder layer post_ln={post_ln}")


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_transformer_layer_bf16(name):
    _run_case(name, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt", "llama", "bert_post_ln", "zero_centered_rms_out_ln_qgelu"])
def test_transformer_layer_gpu(name, dtype):
    """The Triton path (backend "auto" on CUDA) against the reference, fp32 / fp16 / bf16."""
    _run_case(name, dtype, device="cuda")


@pytest.mark.gpu
def test_transformer_layer_fp8_gpu():
    """Native FP8 GEMMs where the GPU has them (emulated otherwise), after calibration."""
    layer = TransformerLayer(256, 1024, 8, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                             device="cuda")
    x = torch.randn(128, 4, 256, dtype=torch.bfloat16, device="cuda")
    y_ref = layer(x)
    with tachyon.fp8_autocast(enabled=False, calibrating=True):
        layer(x)
    with tachyon.fp8_autocast(enabled=True):
        y8 = layer(x)
    assert_close(y8.float(), y_ref.float(), dtype=torch.float8_e4m3fn, name="FP8 vs bf16 output (cuda)")


def test_transformer_layer_dropout_is_reproducible():
    layer = TransformerLayer(64, 96, 4, hidden_dropout=0.2, attention_dropout=0.2)
    x = torch.randn(13, 2, 64)

    def run(seed):
        torch.manual_seed(seed)
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.square().sum().backward()
        return y.detach(), xx.grad, layer.layernorm_mlp.fc1_weight.grad.clone()

    a, b, c = run(5), run(5), run(6)
    for name, u, v in zip(("out", "d_input", "d_fc1_weight"), a, b):
        assert torch.equal(u, v), f"{name}: same torch seed, different result"
    assert not torch.equal(a[0], c[0]), "a different torch seed must give different dropout masks"
    layer.eval()
    no_dropout = TransformerLayer(64, 96, 4, hidden_dropout=0.0, attention_dropout=0.0)
    no_dropout.load_state_dict(layer.state_dict())
    assert_close(layer(x), no_dropout(x), name="eval mode: no dropout")
    assert not torch.allclose(a[0], no_dropout(x), atol=1e-3), "training mode must drop something"


def test_transformer_layer_fp8_close_to_bf16():
    """FP8 GEMMs (emulated on CPU) after one calibration step, within the e4m3 tolerance of bf16."""
    layer = TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16)
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    x_ref, x8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = layer(x_ref)
    y_ref.float().square().sum().backward()
    g_ref = x_ref.grad
    with tachyon.fp8_autocast(enabled=False, calibrating=True):  # records amaxes: the FP8 step has real scales
        layer(x)
    with tachyon.fp8_autocast(enabled=True):
        y8 = layer(x8)
    y8.float().square().sum().backward()
    assert y8.dtype == torch.bfloat16
    assert not torch.equal(y8, y_ref), "fp8_autocast changed nothing: the GEMMs did not run in FP8"
    assert_close(y8.float(), y_ref.float(), dtype=torch.float8_e4m3fn, name="FP8 vs bf16 output")
    assert_close(x8.grad.float(), g_ref.float(), dtype=torch.float8_e4m3fn, name="FP8 vs bf16 input gradient")


INTERPRETED_CASES = {
    # Llama-like, bshd: RMSNorm, RoPE, GQA, swiglu
    "llama_bshd": (dict(num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", attn_input_format="bshd"), (2, 8, 32)),
    # BERT-like post-LN, sbhd, padding: LayerNorm, gelu, biases, bias-dropout-add fused with the output norm
    "bert_sbhd_padding": (dict(output_layernorm=True, apply_residual_connection_post_layernorm=True,
                               self_attn_mask_type="padding"), (8, 2, 32)),
    # GPT-like pre-LN, sbhd, causal: QKV bias inside the packed attention, residual adds fused into the norms
    "gpt_sbhd": (dict(), (8, 2, 32)),
}


@pytest.mark.parametrize("name", list(INTERPRETED_CASES))
def test_transformer_layer_triton_path_interpreted(name):
    """Every kernel of the layer (norms, RoPE, attention, activation, bias-dropout-add (+ norm)) on
    the Triton path, dropout on: same torch seed, same Philox masks, so it matches the torch path."""
    from tests.utils.interpreter import triton_skip_reason

    reason = triton_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cfg, shape = INTERPRETED_CASES[name]
    layer = TransformerLayer(32, 64, 4, hidden_dropout=0.1, attention_dropout=0.1, **cfg)
    _perturb_norms(layer)
    x = torch.randn(shape)
    kwargs = {}
    if cfg.get("attn_input_format") == "bshd":
        kwargs["rotary_pos_emb"] = RotaryPositionEmbedding(8)(8)
    elif cfg.get("self_attn_mask_type") == "padding":
        kwargs["attention_mask"] = padding_mask([8, 5], 8)

    def run(backend):
        torch.manual_seed(11)
        xx = x.clone().requires_grad_()
        with tachyon.use_backend(backend):
            y = layer(xx, **kwargs)
            grads = torch.autograd.grad(y.square().sum(), [xx, *layer.parameters()])
        return [y, *grads]

    names = ["out", "d_input", *[n for n, _ in layer.named_parameters()]]
    failures = []
    for param_name, got, want in zip(names, run("triton"), run("torch")):
        try:
            assert_close(got, want, name=f"triton vs torch: {param_name}")
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


class _ComposedLayer(TransformerLayer):
    """Replaces _bda (as a user subclass may): the layer runs its blocks as separate calls (each
    module's own norm, unpacked attention, a seed drawn per dropout)."""

    def _bda(self, x, bias, residual, scale=1.0):
        return super()._bda(x, bias, residual, scale)


@pytest.mark.parametrize("name", ["gpt", "llama", "bert_post_ln"])
def test_fused_and_composed_paths_agree(name):
    """The fused forward (norm2 inside the residual add, residual branches out of the norms,
    packed attention with the QKV bias or RoPE inside) computes the composed forward's numbers,
    forward and every gradient, within the fp32 table."""
    cfg, mask_type, seq, rope_kind = LAYER_CASES[name]
    fused = TransformerLayer(**cfg, hidden_dropout=0.0, attention_dropout=0.0)
    _perturb_norms(fused)
    composed = _ComposedLayer(**cfg, hidden_dropout=0.0, attention_dropout=0.0)
    composed.load_state_dict(fused.state_dict())
    assert fused._fusable() and not composed._fusable()
    fmt = cfg.get("attn_input_format", "sbhd")
    x = torch.randn(*((seq, 2) if fmt == "sbhd" else (2, seq)), cfg["hidden_size"])
    kwargs = {"self_attn_mask_type": mask_type}
    if mask_type.startswith("padding"):
        kwargs["attention_mask"] = padding_mask([seq, seq - 5], seq)
    if rope_kind:
        kwargs["rotary_pos_emb"] = RotaryPositionEmbedding(cfg["hidden_size"] // cfg["num_attention_heads"])(seq)
    results = []
    for layer in (fused, composed):
        xx = x.clone().requires_grad_()
        y = layer(xx, **kwargs)
        results.append([y, *torch.autograd.grad(y.square().sum(), [xx, *layer.parameters()])])
    names = ["out", "d_input", *[n for n, _ in fused.named_parameters()]]
    for param_name, got, want in zip(names, *results):
        assert_close(got, want, name=f"fused vs composed: {param_name}")


def test_transformer_layer_compiles_fullgraph():
    """torch.compile traces the whole layer (custom ops with fake implementations), no graph break
    without dropout (a dropout seed is drawn with .item(), a graph break)."""
    layer = TransformerLayer(64, 176, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", bias=False,
                             attn_input_format="bshd", hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(2, 13, 64)
    rope = RotaryPositionEmbedding(16)(13)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    ya, yb = compiled(xa, rotary_pos_emb=rope), layer(xb, rotary_pos_emb=rope)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert_close(ya, yb, name="compiled forward")
    assert_close(xa.grad, xb.grad, name="compiled input gradient")


def test_transformer_layer_bad_input():
    with pytest.raises(ValueError, match="layer_type"):
        TransformerLayer(64, 128, 4, layer_type="encoder-decoder")
    with pytest.raises(ValueError, match="needs encoder_output"):
        TransformerLayer(64, 128, 4, layer_type="decoder")(torch.randn(3, 2, 64))
    with pytest.raises(ValueError, match="need layer_type='decoder'"):
        TransformerLayer(64, 128, 4)(torch.randn(3, 2, 64), encoder_output=torch.randn(3, 2, 64))
    with pytest.raises(ValueError, match="activation"):
        TransformerLayer(64, 128, 4, activation="tanh")
    with pytest.raises(ValueError, match="attn_input_format"):
        TransformerLayer(64, 128, 4, attn_input_format="thd")
    with pytest.raises(ValueError, match="hidden_dropout"):
        TransformerLayer(64, 128, 4, hidden_dropout=-0.1)
    layer = TransformerLayer(64, 128, 4)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(2, 64))
    with pytest.raises(ValueError, match="from_hf"):
        TransformerLayer.from_hf(torch.nn.Linear(4, 4))


# ----------------------------------------------------------------------------------------------
# progressive layer drop
# ----------------------------------------------------------------------------------------------


def _seed_with_draw(keep: float, kept: bool) -> int:
    """A torch seed whose next CPU draw keeps (or drops) a layer with probability ``keep``."""
    for seed in range(1000):
        torch.manual_seed(seed)
        if (float(torch.rand(())) < keep) == kept:
            return seed
    raise AssertionError("no seed found")


def _pld_layer(**kw):
    torch.manual_seed(0)
    layer = TransformerLayer(32, 48, 2, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
                             layer_number=3, num_layers=4, **kw)
    _perturb_norms(layer)
    return layer


def test_pld_dropped_layer_is_the_identity_and_gets_no_gradient():
    layer, theta = _pld_layer(), 0.6
    keep = 1 - 3 / 4 * (1 - theta)
    x = torch.randn(2, 5, 32, requires_grad=True)
    torch.manual_seed(_seed_with_draw(keep, kept=False))
    y = layer(x, progressive_layer_drop=True, pld_theta=theta)
    assert y is x
    (y * 2).sum().backward()
    assert all(p.grad is None for p in layer.parameters()), "a dropped layer's parameters got gradients"


def test_pld_kept_layer_divides_each_residual_branch_by_its_keep_probability():
    layer, theta = _pld_layer(), 0.6
    keep = 1 - 3 / 4 * (1 - theta)
    # the oracle: the same layer without PLD, its branch output projections (proj, fc2) times 1 / keep
    oracle = copy.deepcopy(layer)
    with torch.no_grad():
        for p in (oracle.self_attention.proj.weight, oracle.self_attention.proj.bias,
                  oracle.layernorm_mlp.fc2_weight, oracle.layernorm_mlp.fc2_bias):
            p.mul_(1 / keep)
    x = torch.randn(2, 5, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(_seed_with_draw(keep, kept=True))
    ya = layer(xa, progressive_layer_drop=True, pld_theta=theta)
    yb = oracle(xb)
    assert_close(ya, yb, name="kept layer output")
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert_close(xa.grad, xb.grad, name="input gradient")
    assert_close(layer.layernorm_mlp.fc1_weight.grad, oracle.layernorm_mlp.fc1_weight.grad, atol=1e-5, name="fc1 grad")


def test_pld_is_off_in_eval_mode_and_when_not_asked():
    layer = _pld_layer().eval()
    x = torch.randn(2, 5, 32)
    dense = layer(x)
    for seed in range(20):  # whatever the draw would be, every layer runs unscaled
        torch.manual_seed(seed)
        assert torch.equal(layer(x, progressive_layer_drop=True, pld_theta=0.01), dense)
    layer.train()
    assert torch.equal(layer(x, progressive_layer_drop=False, pld_theta=0.01), dense)


def test_pld_refreshes_the_fp8_weight_cache_when_the_first_micro_batch_skipped_the_layer():
    """Dropped on the first micro-batch (is_first_microbatch=True), kept on the next (False): the
    layer must cast its current weights rather than reuse the previous step's cached ones."""
    from tachyon.fp8 import DelayedScaling, fp8_autocast

    layer, theta = _pld_layer(), 0.6
    keep = 1 - 3 / 4 * (1 - theta)
    x = torch.randn(2, 8, 32)
    recipe = DelayedScaling(amax_history_len=4)
    with fp8_autocast(fp8_recipe=recipe):  # step 1: caches the weights
        torch.manual_seed(_seed_with_draw(keep, kept=True))
        layer(x, is_first_microbatch=True, progressive_layer_drop=True, pld_theta=theta)
    with torch.no_grad():  # "the optimizer step": very different weights
        for p in layer.parameters():
            p.mul_(-1.5)
    reference = copy.deepcopy(layer)
    with fp8_autocast(fp8_recipe=recipe):
        torch.manual_seed(_seed_with_draw(keep, kept=False))
        assert layer(x, is_first_microbatch=True, progressive_layer_drop=True, pld_theta=theta) is x
        torch.manual_seed(_seed_with_draw(keep, kept=True))
        got = layer(x, is_first_microbatch=False, progressive_layer_drop=True, pld_theta=theta)
    with fp8_autocast(fp8_recipe=recipe):
        torch.manual_seed(_seed_with_draw(keep, kept=True))
        want = reference(x, is_first_microbatch=None, progressive_layer_drop=True, pld_theta=theta)
    assert_close(got, want, name="output after a skipped first micro-batch")


def test_pld_bad_arguments():
    layer = _pld_layer()
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"pld_theta, a number in \(0, 1\]; got 0"):
        layer(x, progressive_layer_drop=True, pld_theta=0)
    with pytest.raises(ValueError, match="pld_theta, a number in"):
        layer(x, progressive_layer_drop=True)
    with pytest.raises(ValueError, match="progressive_layer_drop must be True or False"):
        layer(x, progressive_layer_drop="yes", pld_theta=0.5)
    layer.layer_number = None
    with pytest.raises(ValueError, match="needs the layer's position in its stack: layer_number"):
        layer(x, progressive_layer_drop=True, pld_theta=0.5)
    layer.layer_number, layer.num_layers = 5, 4
    with pytest.raises(ValueError, match="1 <= layer_number <= num_layers"):
        layer(x, progressive_layer_drop=True, pld_theta=0.5)
    post_ln = TransformerLayer(32, 48, 2, output_layernorm=True, layer_number=1, num_layers=2)
    with pytest.raises(ValueError, match="needs a pre-LN layer"):
        post_ln(torch.randn(5, 2, 32), progressive_layer_drop=True, pld_theta=0.5)


# ----------------------------------------------------------------------------------------------
# HF interop
# ----------------------------------------------------------------------------------------------


def _hf_causal_mask(batch, seq, dtype=torch.float32):
    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None].expand(batch, 1, seq, seq)


def _llama_config(layers=1, attention_bias=False):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                       num_hidden_layers=layers, vocab_size=97, attn_implementation="eager", bos_token_id=1,
                       eos_token_id=2, pad_token_id=0, attention_bias=attention_bias)


def _gpt2_config(layers=1):
    from transformers import GPT2Config

    return GPT2Config(n_embd=64, n_head=4, n_layer=layers, vocab_size=97, n_positions=64, attn_implementation="eager",
                      bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)


def _randomize_norms(module):
    with torch.no_grad():
        for n, t in module.named_parameters():
            if "ln" in n or "norm" in n:
                t.add_(0.1 * torch.randn_like(t))
            elif n.endswith("bias"):
                t.normal_(0, 0.05)


def _compare_forward_and_input_grad(ours, theirs, x, ours_kw, theirs_kw, name):
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa, **ours_kw), theirs(xb, **theirs_kw)
    yb = yb[0] if isinstance(yb, tuple) else yb
    dy = torch.randn_like(yb)
    (ya * dy).sum().backward()
    (yb * dy).sum().backward()
    assert_close(ya, yb, name=f"{name} forward")
    assert_close(xa.grad, xb.grad, name=f"{name} input gradient")


@pytest.mark.parametrize("attention_bias", [False, True])
def test_from_hf_llama_decoder_layer(attention_bias):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = _llama_config(attention_bias=attention_bias)
    hf = LlamaDecoderLayer(config, layer_idx=0).eval()
    _randomize_norms(hf)
    ours = TransformerLayer.from_hf(hf).eval()
    assert ours.self_attention.num_gqa_groups == 2 and ours.layernorm_mlp.activation == "swiglu"
    if attention_bias:  # q/k/v/o biases copied; the MLP (no bias in HF) gets zero biases
        assert ours.layernorm_mlp.fc1_bias is not None and not ours.layernorm_mlp.fc1_bias.any()
    batch, seq = 2, 13
    x = torch.randn(batch, seq, 64)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None].expand(batch, -1))
    _compare_forward_and_input_grad(
        ours, hf, x, {"rotary_pos_emb": RotaryTables(cos[0], sin[0])},
        {"attention_mask": _hf_causal_mask(batch, seq), "position_embeddings": (cos, sin)}, "Llama layer",
    )


@pytest.mark.parametrize("inverse_layer_scale", [False, True])
def test_from_hf_gpt2_block(inverse_layer_scale):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = _gpt2_config()
    config.scale_attn_by_inverse_layer_idx = inverse_layer_scale
    hf = GPT2Block(config, layer_idx=2).eval()
    _randomize_norms(hf)
    ours = TransformerLayer.from_hf(hf).eval()
    assert ours.layernorm_mlp.activation == "gelu" and ours.layernorm_mlp.ffn_hidden_size == 256
    x = torch.randn(3, 13, 64)
    _compare_forward_and_input_grad(ours, hf, x, {}, {"attention_mask": _hf_causal_mask(3, 13)}, "GPT-2 block")


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_layer_adapter_inside_hf_model(arch, attn_implementation):
    """Every layer of a small HF model replaced by HFLayerAdapter: same hidden states on the real
    (unpadded) tokens, with right padding in the batch; eager (additive float masks) and sdpa
    (boolean masks) mask formats."""
    config = _gpt2_config(layers=2) if arch == "gpt2" else _llama_config(layers=2)
    config._attn_implementation = attn_implementation
    if arch == "gpt2":
        from transformers import GPT2Model

        model = GPT2Model(config).eval()
        layers = model.h
    else:
        from transformers import LlamaModel

        model = LlamaModel(config).eval()
        layers = model.layers
    _randomize_norms(model)
    ids = torch.randint(3, 97, (2, 11))
    attention_mask = torch.ones(2, 11, dtype=torch.long)
    attention_mask[1, 7:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        for i, layer in enumerate(layers):
            layers[i] = HFLayerAdapter.from_hf(layer).eval()
        got = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    keep = attention_mask.bool()
    assert_close(got[keep], expected[keep], name=f"{arch} model with adapters")
    with pytest.raises(ValueError, match="use_cache=False"):
        model(input_ids=ids, use_cache=True)



@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_layer_adapter_generate_refuses_cache_and_matches_without(arch):
    """generate() through adapted layers: with HF's default use_cache=True it raises (a cache the
    layers would ignore gives wrong tokens); with use_cache=False it picks HF's greedy tokens."""
    if arch == "gpt2":
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel(_gpt2_config(layers=2)).eval()
        layers = model.transformer.h
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(_llama_config(layers=2)).eval()
        layers = model.model.layers
    _randomize_norms(model)
    ids = torch.randint(3, 97, (2, 6))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        expected = model.generate(ids, use_cache=False, **kwargs)
        for i, layer in enumerate(layers):
            layers[i] = HFLayerAdapter.from_hf(layer).eval()
        with pytest.raises(ValueError, match="use_cache=False"):
            model.generate(ids, **kwargs)
        got = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(got, expected), f"greedy tokens differ:\n{got}\n{expected}"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_layer_adapter_refuses_what_it_cannot_honour(arch):
    """A cache under every name HF has used (keyword and positional), use_cache=True, and unknown
    non-None keywords raise; position_ids / cache_position / None and False values are accepted."""
    x = torch.randn(1, 5, 64)
    kw = {}
    if arch == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        hf = GPT2Block(_gpt2_config(), layer_idx=0)
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        hf = LlamaDecoderLayer(_llama_config(), layer_idx=0)
        kw["position_embeddings"] = LlamaRotaryEmbedding(_llama_config())(x, torch.arange(5)[None])
    adapter = HFLayerAdapter.from_hf(hf).eval()
    cache = object()
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        with pytest.raises(ValueError, match="KV cache"):
            adapter(x, **{name: cache}, **kw)
    params = [p.name for p in inspect.signature(type(hf).forward).parameters.values()][2:]  # after hidden_states
    cache_at = next(i for i, name in enumerate(params) if name in ("cache", "past_key_values"))
    positional = (None,) * cache_at + (cache,)  # where this transformers version puts the cache
    with pytest.raises(ValueError, match="KV cache"):
        adapter(x, *positional, **kw)
    with pytest.raises(ValueError, match="use_cache=False"):
        adapter(x, use_cache=True, **kw)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        adapter(x, cu_seq_lens_q=torch.tensor([0, 5]), **kw)
    with pytest.raises(ValueError, match="output_attentions"):
        adapter(x, output_attentions=True, **kw)
    with pytest.raises(ValueError, match="multiple values"):
        adapter(x, None, **{params[0]: None}, **kw)
    out = adapter(x, position_ids=torch.arange(5)[None], cache_position=torch.arange(5), use_cache=False,
                  output_attentions=False, cache=None, **kw)
    assert out.shape == x.shape


def test_hf_key_padding():
    assert hf_key_padding(None, 5) is None
    assert hf_key_padding(_hf_causal_mask(2, 5), 5) is None, "a pure causal mask pads nothing"
    additive = _hf_causal_mask(2, 5).clone()
    additive[1, :, :, 3:] = torch.finfo(torch.float32).min
    assert torch.equal(hf_key_padding(additive, 5)[:, 0, 0], torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]]).bool())
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    keep[0, :, :, 4] = False
    assert torch.equal(hf_key_padding(keep, 5)[0, 0, 0], torch.tensor([0, 0, 0, 0, 1]).bool())
    assert torch.equal(hf_key_padding(torch.tensor([[1, 1, 0]]), 3)[0, 0, 0], torch.tensor([0, 0, 1]).bool())
    with pytest.raises(ValueError, match="KV caches"):
        hf_key_padding(torch.ones(1, 7), 5)


def test_torch_compile_with_dropout_compiles_once_and_matches_eager():
    """Dropout seeds are drawn as device tensors (no .item(), no int guards): a compiled
    TransformerLayer trains with dropout without graph breaks or recompiles, and with the same
    torch.manual_seed it draws the same masks as eager (outputs and gradients bit-identical)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    layer = TransformerLayer(32, 64, 2, hidden_dropout=0.2, attention_dropout=0.2, attn_input_format="bshd",
                                 backend="torch")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)

    def step(fn, i):
        torch.manual_seed(100 + i)
        x = torch.randn(2, 16, 32, requires_grad=True)
        out = fn(x)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad

    want = [step(layer, i) for i in range(3)]
    got = [step(compiled, 0)]
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        got += [step(compiled, i) for i in (1, 2)]
    assert counters["stats"]["unique_graphs"] == graphs
    for i, ((out, dx), (want_out, want_dx)) in enumerate(zip(got, want)):
        assert torch.equal(out, want_out) and torch.equal(dx, want_dx), f"step {i}"
    assert not torch.equal(want[0][0], step(layer.eval(), 0)[0]), "dropout never engaged"
