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
        heads, kv_heads, head_dim = self.heads()
        hidden = self.config.hidden_size
        act = self.activation(self.config.activation_function)
        layers = []
        for block in t.h:
            w, b = linear(block.attn.c_attn)
            q, k, v = w.split(hidden, dim=0)
            qb, kb, vb = b.split(hidden)
            out, out_b = linear(block.attn.c_proj)
            fc1, fc1_b = linear(block.mlp.c_fc)
            fc2, fc2_b = linear(block.mlp.c_proj)
            layers.append(DecoderLayerWeights(
                ln1=layer_norm(block.ln_1), ln2=layer_norm(block.ln_2),
                attn=AttentionWeights(q, k, v, out, qb, kb, vb, out_b),
                mlp=MLPWeights([fc1], [fc1_b], fc2, fc2_b, act), softmax_scale=float(block.attn.scaling)))
        head, head_b = self.lm_head()
        return DecoderWeights(heads, kv_heads, head_dim, embed=t.wte.weight.detach(), layers=layers,
                              final_norm=layer_norm(t.ln_f), lm_head=head, lm_head_bias=head_b,
                              pos_embed=t.wpe.weight.detach(), max_positions=t.wpe.weight.shape[0])


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
        heads, kv_heads, head_dim = self.heads()
        act = self.activation(self.config.activation_function)
        layers = []
        for index, block in enumerate(t.h):
            a = block.attn.attention
            q, qb = linear(a.q_proj)
            k, kb = linear(a.k_proj)
            v, vb = linear(a.v_proj)
            out, out_b = linear(a.out_proj)
            fc1, fc1_b = linear(block.mlp.c_fc)
            fc2, fc2_b = linear(block.mlp.c_proj)
            local = self.config.attention_layers[index] == "local"
            layers.append(DecoderLayerWeights(
                ln1=layer_norm(block.ln_1), ln2=layer_norm(block.ln_2),
                attn=AttentionWeights(q, k, v, out, qb, kb, vb, out_b),
                mlp=MLPWeights([fc1], [fc1_b], fc2, fc2_b, act), softmax_scale=1.0,
                window=int(self.config.window_size) if local else None))
        head, head_b = self.lm_head()
        return DecoderWeights(heads, kv_heads, head_dim, embed=t.wte.weight.detach(), layers=layers,
                              final_norm=layer_norm(t.ln_f), lm_head=head, lm_head_bias=head_b,
                              pos_embed=t.wpe.weight.detach(), max_positions=t.wpe.weight.shape[0])


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
            q, qb = linear(a.q_proj)
            k, kb = linear(a.k_proj)
            v, vb = linear(a.v_proj)
            out, out_b = linear(a.out_proj)
            fc1, fc1_b = linear(block.mlp.fc_in)
            fc2, fc2_b = linear(block.mlp.fc_out)
            layers.append(DecoderLayerWeights(
                ln1=layer_norm(block.ln_1), ln2=None, attn=AttentionWeights(q, k, v, out, qb, kb, vb, out_b),
                mlp=MLPWeights([fc1], [fc1_b], fc2, fc2_b, act), softmax_scale=head_dim ** -0.5))
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
