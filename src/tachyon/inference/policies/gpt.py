"""Injection policies for HF GPT-2, GPT-Neo and GPT-J (decoders with LayerNorm and a plain MLP).

- GPT-2: learned positions, Conv1D weights ([in, out], transposed here), fused c_attn split into
  q | k | v, score scale ``attn.scaling`` (1/sqrt(d), divided by layer_idx + 1 with
  scale_attn_by_inverse_layer_idx), tied LM head.
- GPT-Neo: learned positions, separate q/k/v without bias, NO score scaling (HF multiplies q k^T
  unscaled), "local" layers attend a sliding window of ``window_size`` keys.
- GPT-J: rotary on the first ``rotary_dim`` dims in GPT-J's interleaved pairs (the model's own
  sin/cos table), attention and MLP in parallel from one LayerNorm, LM head with a bias.
"""

from __future__ import annotations

from torch import nn

from tachyon.inference.policies.base import Policy, layer_norm, linear
from tachyon.inference.weights import AttentionWeights, DecoderLayerWeights, DecoderWeights, MLPWeights, Rotary


class _GPTPolicy(Policy):
    kind = "decoder"
    lm_classes: tuple[str, ...] = ()

    def transformer(self) -> nn.Module:
        return self.model.transformer if type(self.model).__name__ in self.lm_classes else self.model

    def lm_head(self):
        if type(self.model).__name__ not in self.lm_classes:
            return None, None
        head = self.model.lm_head
        return head.weight.detach(), None if head.bias is None else head.bias.detach()

    def heads(self) -> tuple[int, int, int]:
        heads = self.config.num_attention_heads
        return heads, heads, self.config.hidden_size // heads

    def ffn_size(self) -> int:
        inner = getattr(self.config, "n_inner", None) or getattr(self.config, "intermediate_size", None)
        return inner or 4 * self.config.hidden_size

    def _learned_positions(self, layers: list[DecoderLayerWeights]) -> DecoderWeights:
        """The model's weights around ``layers``: embeddings with a learned position table (GPT-2, GPT-Neo)."""
        t = self.transformer()
        heads, kv_heads, head_dim = self.heads()
        head, head_b = self.lm_head()
        return DecoderWeights(heads, kv_heads, head_dim, embed=t.wte.weight.detach(), layers=layers,
                              final_norm=layer_norm(t.ln_f), lm_head=head, lm_head_bias=head_b,
                              pos_embed=t.wpe.weight.detach(), max_positions=t.wpe.weight.shape[0])


def _layer(ln1: nn.Module, ln2: nn.Module | None, qkv: tuple, out: tuple, fc1: nn.Module, fc2: nn.Module, act: str,
           softmax_scale: float, window: int | None = None) -> DecoderLayerWeights:
    """One GPT-style layer's weights: norms (ln2 None: parallel attention and MLP), q/k/v as
    ((q, qb), (k, kb), (v, vb)), the output projection (w, b) and the MLP's two linears."""
    (q, qb), (k, kb), (v, vb) = qkv
    (fc1_w, fc1_b), (fc2_w, fc2_b) = linear(fc1), linear(fc2)
    return DecoderLayerWeights(
        ln1=layer_norm(ln1), ln2=None if ln2 is None else layer_norm(ln2),
        attn=AttentionWeights(q, k, v, out[0], qb, kb, vb, out[1]),
        mlp=MLPWeights([fc1_w], [fc1_b], fc2_w, fc2_b, act), softmax_scale=softmax_scale, window=window)


class GPT2Policy(_GPTPolicy):
    name = "GPT-2"
    lm_classes = ("GPT2LMHeadModel",)
    model_classes = ("GPT2Model", "GPT2LMHeadModel")
    layer_classes = ("GPT2Block",)

    def check(self, tp_size: int) -> None:
        c = self.config
        if getattr(c, "add_cross_attention", False):
            self.refuse("add_cross_attention", True, "False (decoder-only GPT-2)")
        self.activation(c.activation_function)
        self.check_layers(self.transformer().h)

    def extract(self) -> DecoderWeights:
        t = self.transformer()
        hidden = self.config.hidden_size
        act = self.activation(self.config.activation_function)
        layers = []
        for block in t.h:
            w, b = linear(block.attn.c_attn)
            qkv = tuple(zip(w.split(hidden, dim=0), b.split(hidden)))
            layers.append(_layer(block.ln_1, block.ln_2, qkv, linear(block.attn.c_proj), block.mlp.c_fc,
                                 block.mlp.c_proj, act, float(block.attn.scaling)))
        return self._learned_positions(layers)


class GPTNeoPolicy(_GPTPolicy):
    name = "GPT-Neo"
    lm_classes = ("GPTNeoForCausalLM",)
    model_classes = ("GPTNeoModel", "GPTNeoForCausalLM")
    layer_classes = ("GPTNeoBlock",)

    def check(self, tp_size: int) -> None:
        c = self.config
        self.activation(c.activation_function)
        for kind in c.attention_layers:
            if kind not in ("global", "local"):
                self.refuse("attention_layers entry", kind, "'global', 'local'")
        self.check_layers(self.transformer().h)

    def extract(self) -> DecoderWeights:
        t = self.transformer()
        act = self.activation(self.config.activation_function)
        layers = []
        for index, block in enumerate(t.h):
            a = block.attn.attention
            local = self.config.attention_layers[index] == "local"
            layers.append(_layer(block.ln_1, block.ln_2, (linear(a.q_proj), linear(a.k_proj), linear(a.v_proj)),
                                 linear(a.out_proj), block.mlp.c_fc, block.mlp.c_proj, act, 1.0,
                                 window=int(self.config.window_size) if local else None))
        return self._learned_positions(layers)


class GPTJPolicy(_GPTPolicy):
    name = "GPT-J"
    lm_classes = ("GPTJForCausalLM",)
    model_classes = ("GPTJModel", "GPTJForCausalLM")
    layer_classes = ("GPTJBlock",)

    def heads(self) -> tuple[int, int, int]:
        heads = self.config.n_head
        return heads, heads, self.config.n_embd // heads

    def ffn_size(self) -> int:
        return self.config.n_inner or 4 * self.config.n_embd

    def check(self, tp_size: int) -> None:
        self.activation(self.config.activation_function)
        rotary_dim = self.config.rotary_dim
        head_dim = self.heads()[2]
        if rotary_dim is not None and (rotary_dim % 2 or rotary_dim > head_dim):
            self.refuse("rotary_dim", rotary_dim, f"an even number <= head_dim={head_dim}, or None")
        self.check_layers(self.transformer().h)

    def extract(self) -> DecoderWeights:
        t = self.transformer()
        heads, kv_heads, head_dim = self.heads()
        act = self.activation(self.config.activation_function)
        layers = []
        for block in t.h:
            a = block.attn
            layers.append(_layer(block.ln_1, None, (linear(a.q_proj), linear(a.k_proj), linear(a.v_proj)),
                                 linear(a.out_proj), block.mlp.fc_in, block.mlp.fc_out, act, head_dim ** -0.5))
        # the model's own table: [sin(f) | cos(f)] per position; GPT-J repeats each frequency twice
        sincos = t.rotary_emb.embed_positions.detach().float()
        sin, cos = sincos.chunk(2, dim=-1)
        rotary = Rotary(cos.repeat_interleave(2, dim=-1).contiguous(), sin.repeat_interleave(2, dim=-1).contiguous(),
                        interleaved=True)
        head, head_b = self.lm_head()
        return DecoderWeights(heads, kv_heads, head_dim, embed=t.wte.weight.detach(), layers=layers,
                              final_norm=layer_norm(t.ln_f), lm_head=head, lm_head_bias=head_b, rotary=rotary,
                              max_positions=sincos.shape[0])


__all__ = ["GPT2Policy", "GPTJPolicy", "GPTNeoPolicy"]
