"""Model weights in one canonical form, and how tensor slicing cuts them.

An injection policy reads an HF model into these containers (full tensors, [out, in] layout,
HF's own values); :func:`shard_decoder` / :func:`shard_encoder` cut them for one tensor-parallel
rank; the injected layers are then built from what is left. Keeping the cut separate from the
policies means every architecture is sliced by the same tested code:

- column-parallel (each rank computes a slice of the outputs): Q by query heads, K and V by kv
  heads (a rank holds heads [r*h/tp, (r+1)*h/tp)), the MLP's first projection(s) by rows;
  their biases are sliced with them.
- row-parallel (each rank holds the matching input columns and produces a partial sum): the
  attention output projection and the MLP's second projection; one all-reduce after each, then
  the full bias is added once (so the bias is not summed tp times).

Embeddings, norms and the LM head are replicated. Heads, kv heads and the MLP width must divide
by tp_size (checked before any weight is read, with the numbers in the message).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass
class Norm:
    weight: Tensor
    bias: Tensor | None
    eps: float
    kind: str  # "layer" | "rms"


@dataclasses.dataclass
class AttentionWeights:
    q: Tensor  # [heads * head_dim, hidden]
    k: Tensor  # [kv_heads * head_dim, hidden]
    v: Tensor
    out: Tensor  # [hidden, heads * head_dim]
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    out_bias: Tensor | None = None


@dataclasses.dataclass
class MLPWeights:
    fc1: list[Tensor]  # [up] or, gated, [gate, up]: each [ffn, hidden]
    fc1_bias: list[Tensor | None]
    fc2: Tensor  # [hidden, ffn]
    fc2_bias: Tensor | None
    activation: str  # a tachyon.kernels.activation name: "gelu_tanh", "gelu", "relu", "silu", "swiglu", ...


@dataclasses.dataclass
class DecoderLayerWeights:
    ln1: Norm
    ln2: Norm | None  # None: parallel attention + MLP from ln1's output (GPT-J)
    attn: AttentionWeights
    mlp: MLPWeights
    softmax_scale: float
    window: int | None = None  # sliding-window attention (GPT-Neo local layers, Mistral, Qwen2)


@dataclasses.dataclass
class Rotary:
    cos: Tensor  # fp32 [max_positions, rotary_dim], the model's own values
    sin: Tensor
    interleaved: bool  # GPT-J pairs (2i, 2i+1) vs rotate-half


@dataclasses.dataclass
class DecoderWeights:
    heads: int
    kv_heads: int
    head_dim: int
    embed: Tensor  # [vocab, hidden]
    layers: list[DecoderLayerWeights]
    final_norm: Norm
    lm_head: Tensor | None  # [vocab, hidden]; None for a base model (hidden states out)
    lm_head_bias: Tensor | None = None
    pos_embed: Tensor | None = None  # learned absolute positions [max_positions, hidden]
    rotary: Rotary | None = None
    max_positions: int | None = None
    vocab_size: int | None = None  # logit columns: the first vocab_size rows of lm_head (None: all of them);
    # set when the embedding has padding rows that are never answers (tachyon's GPT)


@dataclasses.dataclass
class EncoderLayerWeights:
    """A post-LN BERT layer: y = LN_attn(x + attn(x)); out = LN_out(y + mlp(y))."""

    attn: AttentionWeights
    ln_attn: Norm
    mlp: MLPWeights
    ln_out: Norm
    heads: int
    head_dim: int


def check_divisible(tp_size: int, **sizes: int) -> None:
    """ValueError naming every size tp_size does not divide."""
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp_size]
    if bad:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} must divide the model's {', '.join(bad)} "
                         f"(tensor slicing gives each rank whole heads and an equal share of the MLP); "
                         f"allowed tp_size: common divisors of {', '.join(f'{k}={v}' for k, v in sizes.items())}")


def _rows(t: Tensor | None, rank: int, tp: int) -> Tensor | None:
    return None if t is None else t.chunk(tp, dim=0)[rank]


def _cols(t: Tensor, rank: int, tp: int) -> Tensor:
    return t.chunk(tp, dim=1)[rank]


def shard_attention(a: AttentionWeights, rank: int, tp: int) -> AttentionWeights:
    """Q, K, V rows and the output projection's columns of this rank's heads (head-major rows,
    so an even chunk is whole heads when tp divides the head counts)."""
    if tp == 1:
        return a
    return AttentionWeights(
        q=_rows(a.q, rank, tp), k=_rows(a.k, rank, tp), v=_rows(a.v, rank, tp), out=_cols(a.out, rank, tp),
        q_bias=_rows(a.q_bias, rank, tp), k_bias=_rows(a.k_bias, rank, tp), v_bias=_rows(a.v_bias, rank, tp),
        out_bias=a.out_bias,
    )


def shard_mlp(m: MLPWeights, rank: int, tp: int) -> MLPWeights:
    """Each first projection (gate and up separately) by rows, the second by columns."""
    if tp == 1:
        return m
    return MLPWeights(fc1=[_rows(w, rank, tp) for w in m.fc1], fc1_bias=[_rows(b, rank, tp) for b in m.fc1_bias],
                      fc2=_cols(m.fc2, rank, tp), fc2_bias=m.fc2_bias, activation=m.activation)


def shard_decoder(w: DecoderWeights, rank: int, tp: int) -> DecoderWeights:
    check_divisible(tp, heads=w.heads, kv_heads=w.kv_heads,
                    intermediate_size=w.layers[0].mlp.fc1[0].shape[0] if w.layers else tp)
    if tp == 1:
        return w
    layers = [dataclasses.replace(layer, attn=shard_attention(layer.attn, rank, tp), mlp=shard_mlp(layer.mlp, rank, tp))
              for layer in w.layers]
    return dataclasses.replace(w, heads=w.heads // tp, kv_heads=w.kv_heads // tp, layers=layers)


def shard_encoder(layers: list[EncoderLayerWeights], rank: int, tp: int) -> list[EncoderLayerWeights]:
    if layers:
        check_divisible(tp, heads=layers[0].heads, intermediate_size=layers[0].mlp.fc1[0].shape[0])
    if tp == 1:
        return layers
    return [dataclasses.replace(layer, attn=shard_attention(layer.attn, rank, tp), mlp=shard_mlp(layer.mlp, rank, tp),
                                heads=layer.heads // tp) for layer in layers]


def fused_bias(weights: list[Tensor], biases: list[Tensor | None]) -> Tensor | None:
    """The bias of row blocks fused into one projection (q | k | v, gate | up): None when no block
    has one, else the blocks' biases concatenated with zeros for the blocks without."""
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


__all__ = ["AttentionWeights", "DecoderLayerWeights", "DecoderWeights", "EncoderLayerWeights", "MLPWeights", "Norm",
           "Rotary", "check_divisible", "fused_bias", "shard_decoder", "shard_encoder"]
