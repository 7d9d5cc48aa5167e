"""The memory flags of the BERT kernel layer: each strictly lowers the bytes saved for backward
(unique storages, measured with saved_tensors_hooks) and leaves outputs and gradients equal to
the flag-off layer; the layer saves less than HF's BertLayer."""

from __future__ import annotations

import itertools

import pytest
import torch

from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.nn.transformer_kernel import saved_bytes_per_layer, saved_tensor_bytes
from tests.nn.test_transformer_kernel import padding_mask, randomize
from tests.utils import assert_close

FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")
BATCH, SEQ, HIDDEN, HEADS = 2, 24, 64, 4


def _layer(pre_ln: bool, backend: str = "torch", **flags) -> TransformerKernelLayer:
    config = TransformerKernelConfig(batch_size=4, max_seq_length=64, hidden_size=HIDDEN, heads=HEADS,
                                     attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                     initializer_range=0.02, seed=99, pre_layer_norm=pre_ln, **flags)
    layer = TransformerKernelLayer(config, backend=backend)
    layer.layer_id = 0  # every flag setting gets the same dropout streams
    return randomize(layer)


def _measure(layer, x, mask, grad):
    """(saved bytes, output, dx, parameter grads)."""
    xx = x.clone().requires_grad_()
    out, nbytes = saved_tensor_bytes(lambda: layer(xx, mask), exclude=layer.parameters())
    out.backward(grad)
    return nbytes, out.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_each_flag_strictly_lowers_saved_bytes_and_keeps_gradients(pre_ln):
    x, grad = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
    mask = padding_mask(BATCH, SEQ)
    results = {}
    for on in itertools.product([False, True], repeat=len(FLAGS)):
        flags = dict(zip(FLAGS, on))
        results[on] = _measure(_layer(pre_ln, **flags), x, mask, grad)
    base_bytes, base_out, base_dx, base_grads = results[(False, False, False)]
    for on, (nbytes, out, dx, grads) in results.items():
        label = ", ".join(f for f, v in zip(FLAGS, on) if v) or "no flags"
        for i, flag in enumerate(FLAGS):
            if not on[i]:
                with_flag = results[on[:i] + (True,) + on[i + 1:]][0]
                assert with_flag < nbytes, f"{flag} on top of [{label}]: saved {with_flag} bytes, not less than {nbytes}"
        assert_close(out, base_out, name=f"out [{label}]")
        assert_close(dx, base_dx, name=f"dx [{label}]")
        for name, g in grads.items():
            assert_close(g, base_grads[name], atol=1e-4, name=f"{name} [{label}]")


@pytest.mark.parametrize("pre_ln", [True, False], ids=["preLN", "postLN"])
def test_flag_savings_per_layer_in_a_stack_are_what_the_docs_say(pre_ln):
    """fp32, per token, one layer's share of a stack: normalize_invertible drops the inputs of
    the LayerNorms (2 hidden-size tensors; pre-LN's last add has none) and their fp32 means,
    gelu_checkpoint the GELU output (intermediate size), attn_dropout_checkpoint q, k, v (3 hidden;
    the attention output is kept by the Wo GEMM anyway) and the fp32 logsumexp (one per head), in pre-LN also the first
    LayerNorm's output and fp32 mean and rstd (recomputed too)."""
    x = torch.randn(BATCH, SEQ, HIDDEN)
    tokens, f32 = BATCH * SEQ, 4

    def per_layer(**flags):
        return saved_bytes_per_layer(_layer(pre_ln, **flags), _layer(pre_ln, **flags), x)

    base = per_layer()
    assert base - per_layer(normalize_invertible=True) == tokens * 2 * (HIDDEN + 1) * f32
    assert base - per_layer(gelu_checkpoint=True) == tokens * 4 * HIDDEN * f32
    ln_in = HIDDEN + 2 if pre_ln else 0
    assert base - per_layer(attn_dropout_checkpoint=True) == tokens * (3 * HIDDEN + HEADS + ln_in) * f32


def test_triton_backend_flags_also_lower_saved_bytes():
    x, grad = torch.randn(2, 7, 32), torch.randn(2, 7, 32)

    def layer(**flags):
        config = TransformerKernelConfig(batch_size=2, max_seq_length=8, hidden_size=32, heads=2,
                                         attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                         initializer_range=0.02, seed=5, pre_layer_norm=True, **flags)
        out = randomize(TransformerKernelLayer(config, backend="triton"))
        out.layer_id = 0
        return out

    base = _measure(layer(), x, None, grad)
    everything = _measure(layer(**dict.fromkeys(FLAGS, True)), x, None, grad)
    assert everything[0] < base[0]
    assert_close(everything[2], base[2], name="dx")
    for name, g in everything[3].items():
        assert_close(g, base[3][name], atol=1e-4, name=name)


def test_kernel_layer_saves_less_than_hf_bert_layer():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    hf_config = BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=4 * HIDDEN)
    hf_config._attn_implementation = "eager"
    hf = BertLayer(hf_config).train()
    ours = TransformerKernelLayer.from_hf(hf)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    _, hf_bytes = saved_tensor_bytes(lambda: hf(x), exclude=hf.parameters())
    _, our_bytes = saved_tensor_bytes(lambda: ours(x), exclude=ours.parameters())
    assert our_bytes < hf_bytes, (our_bytes, hf_bytes)
