"""Injection policy for tachyon's own decoder, :class:`tachyon.train.models.GPT`.

GPT is token embeddings (+ a learned position table, or RoPE inside attention) -> a stack of
:class:`tachyon.nn.TransformerLayer` (bshd, causal, pre-LN) -> final norm -> LM head. Where each
weight lives in a TransformerLayer (Transformer Engine's names):

    self_attention.layernorm_qkv      norm1 (layer_norm_weight / layer_norm_bias / eps) and the fused
                                      QKV weight [(h + 2 g) d, hidden], rows q | k | v, head-major
    self_attention.proj               the output projection [hidden, h d] and its bias
    layernorm_mlp                     norm2, fc1_weight [ffn (x2 gated: gate half first), hidden],
                                      fc1_bias, fc2_weight [hidden, ffn], fc2_bias

The layer computes h = x + proj(attn(norm1(x))); y = h + fc2(act(fc1(norm2(h)))), the injected
decoder's order. Scores are scaled by the attention's ``softmax_scale`` (default 1/sqrt(d)); GQA
with ``num_gqa_groups`` kv heads. RoPE: GPT builds ``RotaryPositionEmbedding(head_dim)`` (base
10000, rotate-half, angles cat([a, a])) at every call; the same module gives the cos/sin table
here, for ``max_seq_len`` positions. Activations keep TE's definitions: "gelu" is the tanh
approximation ("gelu_tanh"), "geglu" is gelu_tanh(gate) * up, "swiglu" silu(gate) * up.

The embedding has ``padded_vocab_size(vocab_size)`` rows (a multiple of 64); the injected model
produces only the first ``vocab_size`` logit columns, as GPT.logits does.

Refused (the injected decoder would not reproduce them): post-LN layers
(``apply_residual_connection_post_layernorm``, ``output_layernorm``), a mask type other than
"causal", cross-attention (``layer_type="decoder"``), an sbhd layer (GPT feeds bshd),
``zero_centered_gamma``, interleaved RoPE pairs, and subclasses of TransformerLayer (e.g.
tensor parallelism's), whose forward may differ.
"""

from __future__ import annotations

from torch import Tensor, nn

from tachyon.inference.policies.base import Policy
from tachyon.inference.weights import AttentionWeights, DecoderLayerWeights, DecoderWeights, MLPWeights, Norm, Rotary

# TransformerLayer activation -> tachyon.kernels.activation name (same formula)
TE_ACTIVATIONS = {"gelu": "gelu_tanh", "geglu": "geglu_tanh", "swiglu": "swiglu", "relu": "relu", "silu": "silu",
                  "qgelu": "qgelu"}
GATED = ("geglu", "swiglu")


def _norm(weight: Tensor, bias: Tensor | None, eps: float, normalization: str) -> Norm:
    return Norm(weight.detach(), None if bias is None else bias.detach(), float(eps),
                "rms" if normalization == "RMSNorm" else "layer")


def _detach(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach()


class TachyonGPTPolicy(Policy):
    name = "tachyon GPT"
    kind = "decoder"
    model_classes = ("tachyon.train.models.GPT",)  # listed in refusals; matched by isinstance
    layer_classes = ("TransformerLayer",)

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        from tachyon.train.models import GPT

        return isinstance(model, GPT)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = None  # a tachyon GPT has no HF config: sizes are read from its modules

    def heads(self) -> tuple[int, int, int]:
        a = self.model.layers[0].self_attention
        return a.num_attention_heads, a.num_gqa_groups, a.kv_channels

    def ffn_size(self) -> int:
        return self.model.layers[0].ffn_hidden_size

    def check(self, tp_size: int) -> None:
        from tachyon.nn import LayerNorm, RMSNorm, TransformerLayer

        m = self.model
        if len(m.layers) == 0:
            self.refuse("num_layers", 0, ">= 1")
        first = self.heads()
        for index, layer in enumerate(m.layers):
            if type(layer) is not TransformerLayer:
                raise ValueError(f"GPT: layer {index} is a {type(layer).__name__}, not tachyon.nn.TransformerLayer; "
                                 "a subclass or patched layer cannot be injected exactly")
            where = f"layers[{index}]."
            settings = {
                "apply_residual_connection_post_layernorm": (layer.apply_residual_connection_post_layernorm, False),
                "output_layernorm": (layer.output_layernorm, False),
                "layer_type": (layer.layer_type, "encoder"),
                "self_attn_mask_type": (layer.self_attn_mask_type, "causal"),
                "attn_input_format": (layer.attn_input_format, "bshd"),
                "zero_centered_gamma": (bool(layer.zero_centered_gamma), False),
                "self_attention.rotary_pos_interleaved": (layer.self_attention.rotary_pos_interleaved, False),
            }
            for key, (value, supported) in settings.items():
                if value != supported:
                    self.refuse(where + key, value, repr(supported))
            if layer.layernorm_mlp.activation not in TE_ACTIVATIONS:
                self.refuse(where + "activation", layer.layernorm_mlp.activation, ", ".join(TE_ACTIVATIONS))
            a = layer.self_attention
            sizes = (a.num_attention_heads, a.num_gqa_groups, a.kv_channels)
            if sizes != first:
                self.refuse(where + "(heads, kv heads, head dim)", sizes, f"the same in every layer: {first}")
            if m.position == "rope" and a.kv_channels != m.head_dim:
                self.refuse(where + "kv_channels", a.kv_channels, f"GPT.head_dim={m.head_dim} (the RoPE table's dim)")
        if m.position not in ("learned", "rope"):
            self.refuse("position", m.position, "'learned', 'rope'")
        if type(m.final_norm) not in (LayerNorm, RMSNorm) or getattr(m.final_norm, "weight", None) is None:
            self.refuse("final_norm", type(m.final_norm).__name__, "an affine tachyon.nn.LayerNorm or RMSNorm")
        if m.lm_head.bias is not None:
            self.refuse("lm_head.bias", "present", "no bias (GPT's head)")

    def _layer(self, layer: nn.Module) -> DecoderLayerWeights:
        a, mlp = layer.self_attention, layer.layernorm_mlp
        qkv = a.layernorm_qkv
        heads, kv_heads, head_dim = a.num_attention_heads, a.num_gqa_groups, a.kv_channels
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        q, k, v = qkv.weight.detach().split(sizes, dim=0)
        qb, kb, vb = (None, None, None) if qkv.bias is None else qkv.bias.detach().split(sizes)
        if mlp.activation in GATED:  # [gate | up] halves of fc1, sliced separately under tensor parallelism
            fc1 = list(mlp.fc1_weight.detach().chunk(2, dim=0))
            fc1_b = [None, None] if mlp.fc1_bias is None else list(mlp.fc1_bias.detach().chunk(2))
        else:
            fc1, fc1_b = [mlp.fc1_weight.detach()], [_detach(mlp.fc1_bias)]
        scale = a.core_attention.softmax_scale
        return DecoderLayerWeights(
            ln1=_norm(qkv.layer_norm_weight, qkv.layer_norm_bias, qkv.eps, qkv.normalization),
            ln2=_norm(mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.eps, mlp.normalization),
            attn=AttentionWeights(q, k, v, a.proj.weight.detach(), qb, kb, vb, _detach(a.proj.bias)),
            mlp=MLPWeights(fc1, fc1_b, mlp.fc2_weight.detach(), _detach(mlp.fc2_bias), TE_ACTIVATIONS[mlp.activation]),
            softmax_scale=float(head_dim ** -0.5 if scale is None else scale))

    def extract(self) -> DecoderWeights:
        from tachyon.nn import RMSNorm, RotaryPositionEmbedding

        m = self.model
        heads, kv_heads, head_dim = self.heads()
        positions = int(m.max_seq_len)
        rotary, pos_embed = None, None
        if m.position == "rope":
            device = m.token_embedding.weight.device
            cos, sin = RotaryPositionEmbedding(head_dim, device=device).cos_sin(positions)
            rotary = Rotary(cos, sin, interleaved=False)
        else:
            pos_embed = m.position_embedding.weight.detach()
            positions = min(positions, pos_embed.shape[0])
        final = m.final_norm
        final_norm = _norm(final.weight, getattr(final, "bias", None), final.eps,
                           "RMSNorm" if isinstance(final, RMSNorm) else "LayerNorm")
        return DecoderWeights(heads, kv_heads, head_dim, embed=m.token_embedding.weight.detach(),
                              layers=[self._layer(layer) for layer in m.layers], final_norm=final_norm,
                              lm_head=m.lm_head.weight.detach(), pos_embed=pos_embed, rotary=rotary,
                              max_positions=positions, vocab_size=int(m.vocab_size))


__all__ = ["TE_ACTIVATIONS", "TachyonGPTPolicy"]
