"""Injection policy for Llama-style decoders: Llama, Mistral, Qwen2 (RMSNorm, RoPE, GQA, SwiGLU).

RoPE tables come from the model's own rotary module (its ``inv_freq`` and ``attention_scaling``),
so every rope type whose frequencies do not change with the sequence length is exact: "default",
"linear", "llama3", "yarn". "dynamic" (NTK scaling that recomputes the frequencies once a sequence
outgrows the original context) and "longrope" (two frequency sets switched by length) are refused.
Sliding windows: Mistral's ``sliding_window`` on every layer, Qwen2's on the layers its
``layer_types`` mark "sliding_attention".
"""

from __future__ import annotations

from tachyon.inference.policies.base import Policy, linear, rms_norm, rope_table
from tachyon.inference.weights import AttentionWeights, DecoderLayerWeights, DecoderWeights, MLPWeights, Rotary

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LlamaPolicy(Policy):
    name = "Llama-style"
    kind = "decoder"
    model_classes = ("LlamaModel", "LlamaForCausalLM", "MistralModel", "MistralForCausalLM", "Qwen2Model",
                     "Qwen2ForCausalLM")
    layer_classes = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")

    def base(self):
        return self.model.model if type(self.model).__name__.endswith("ForCausalLM") else self.model

    def heads(self) -> tuple[int, int, int]:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads, head_dim

    def ffn_size(self) -> int:
        return self.config.intermediate_size

    def rope_type(self) -> str:
        params = getattr(self.config, "rope_parameters", None) or getattr(self.config, "rope_scaling", None) or {}
        return params.get("rope_type", params.get("type", "default"))

    def windows(self) -> list[int | None]:
        c = self.config
        n = c.num_hidden_layers
        window = getattr(c, "sliding_window", None)
        types = getattr(c, "layer_types", None)
        if window is None:
            return [None] * n
        if types is not None:
            return [int(window) if t == "sliding_attention" else None for t in types]
        return [int(window)] * n

    def check(self, tp_size: int) -> None:
        c = self.config
        rope = self.rope_type()
        if rope not in STATIC_ROPE_TYPES:
            self.refuse("rope type", rope, ", ".join(map(repr, STATIC_ROPE_TYPES)))
        self.activation(c.hidden_act, gated=True)
        types = getattr(c, "layer_types", None)
        if types is not None and any(t not in ("full_attention", "sliding_attention") for t in types):
            self.refuse("layer_types", types, "'full_attention' and 'sliding_attention' entries")
        if getattr(c, "pretraining_tp", 1) not in (1, None):
            self.refuse("pretraining_tp", c.pretraining_tp, "1")
        self.check_layers(self.base().layers)

    def extract(self) -> DecoderWeights:
        base = self.base()
        heads, kv_heads, head_dim = self.heads()
        act = self.activation(self.config.hidden_act, gated=True)
        layers = []
        for layer, window in zip(base.layers, self.windows()):
            a, m = layer.self_attn, layer.mlp
            q, qb = linear(a.q_proj)
            k, kb = linear(a.k_proj)
            v, vb = linear(a.v_proj)
            out, out_b = linear(a.o_proj)
            gate, gate_b = linear(m.gate_proj)
            up, up_b = linear(m.up_proj)
            down, down_b = linear(m.down_proj)
            layers.append(DecoderLayerWeights(
                ln1=rms_norm(layer.input_layernorm), ln2=rms_norm(layer.post_attention_layernorm),
                attn=AttentionWeights(q, k, v, out, qb, kb, vb, out_b),
                mlp=MLPWeights([gate, up], [gate_b, up_b], down, down_b, act),
                softmax_scale=float(a.scaling), window=window))
        positions = int(self.config.max_position_embeddings)
        rotary_emb = base.rotary_emb
        cos, sin = rope_table(rotary_emb.inv_freq.detach(), positions, float(rotary_emb.attention_scaling))
        head = None
        if type(self.model).__name__.endswith("ForCausalLM"):
            head = self.model.lm_head.weight.detach()
        return DecoderWeights(heads, kv_heads, head_dim, embed=base.embed_tokens.weight.detach(), layers=layers,
                              final_norm=rms_norm(base.norm), lm_head=head, rotary=Rotary(cos, sin, False),
                              max_positions=positions)


__all__ = ["LlamaPolicy", "STATIC_ROPE_TYPES"]
