"""Injection policy for HF BERT and RoBERTa encoders (any head: MaskedLM, classification, ...).

Only the encoder layers are replaced (by :class:`tachyon.inference.layers.EncoderLayer`, in place,
inside HF's own model), so embeddings, pooler, heads, masks and outputs stay HF's. Refused: decoder
configurations (is_decoder, cross-attention), activations the fused bias+activation kernel does not
compute, layers that are not HF's BertLayer / RobertaLayer.
"""

from __future__ import annotations

from torch import nn

from tachyon.inference.policies.base import Policy, layer_norm, linear
from tachyon.inference.weights import AttentionWeights, EncoderLayerWeights, MLPWeights

_HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
          "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction")


class BertPolicy(Policy):
    name = "BERT/RoBERTa"
    kind = "encoder"
    model_classes = tuple(f"{family}{head}" for family in ("Bert", "Roberta") for head in _HEADS
                          if not (family == "Roberta" and head in ("ForPreTraining", "ForNextSentencePrediction")))
    layer_classes = ("BertLayer", "RobertaLayer")

    def layer_lists(self) -> list[nn.ModuleList]:
        lists = [m for m in self.model.modules() if isinstance(m, nn.ModuleList) and len(m)
                 and type(m[0]).__name__ in self.layer_classes]
        if not lists:
            raise ValueError(f"{type(self.model).__name__}: no BertLayer/RobertaLayer found to inject")
        return lists

    def heads(self) -> tuple[int, int, int]:
        heads = self.config.num_attention_heads
        return heads, heads, self.config.hidden_size // heads

    def ffn_size(self) -> int:
        return self.config.intermediate_size

    def check(self, tp_size: int) -> None:
        c = self.config
        if getattr(c, "is_decoder", False) or getattr(c, "add_cross_attention", False):
            self.refuse("is_decoder / add_cross_attention", True, "encoder configurations (both False)")
        self.activation(c.hidden_act)
        for layers in self.layer_lists():
            self.check_layers(layers)

    def extract_layer(self, layer: nn.Module) -> EncoderLayerWeights:
        s, o = layer.attention.self, layer.attention.output
        q, qb = linear(s.query)
        k, kb = linear(s.key)
        v, vb = linear(s.value)
        out, out_b = linear(o.dense)
        fc1, fc1_b = linear(layer.intermediate.dense)
        fc2, fc2_b = linear(layer.output.dense)
        heads, _, head_dim = self.heads()
        return EncoderLayerWeights(
            attn=AttentionWeights(q, k, v, out, qb, kb, vb, out_b), ln_attn=layer_norm(o.LayerNorm),
            mlp=MLPWeights([fc1], [fc1_b], fc2, fc2_b, self.activation(self.config.hidden_act)),
            ln_out=layer_norm(layer.output.LayerNorm), heads=heads, head_dim=head_dim)


__all__ = ["BertPolicy"]
