"""The GPT of ``tachyon train`` (tachyon.train.models.GPT) as a pipeline layer list.

    layers = gpt_layer_specs(vocab_size=262, hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128)
    net = PipelineModule(layers, num_stages=2, loss_fn=gpt_loss, partition_method="type:TransformerLayer")
    net.load_full_state_dict(gpt_state_dict_to_pipeline(gpt.state_dict(), num_layers=4))

Same computation as GPT.forward, one layer per step so the pipeline can cut between them:

    0            token embedding (TiedLayerSpec "embed" when tie_embeddings)       ids [b, s] -> [b, s, h]
    1            learned positions, x + P[:s] (position="learned" only)
    next L       GPTBlock: tachyon.nn.TransformerLayer (bshd, causal), RoPE tables made inside
    next         final norm
    last         LM head: the tied embedding's weight (forward_fn) or a Linear   -> logits [b, s, vocab_size]

and ``gpt_loss(logits, labels)`` is GPT's loss (fp32 cross-entropy, -100 ignored). Parameter
names follow PipelineModule's (layer index, ``tied_modules.embed``);
:func:`gpt_state_dict_to_pipeline` / :func:`pipeline_state_dict_to_gpt` map GPT's state dict to
them and back, so a GPT checkpoint loads into any pipeline layout and a pipeline's weights export
to the single-process model. Initialization: normal(0, 0.02) embeddings and positions, GPT-2's
scaled init for the residual projections (load a GPT state dict for GPT's exact start, which
begins the positions at sinusoids).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tachyon.nn as tnn
from tachyon.parallel.pipeline.spec import LayerSpec, TiedLayerSpec

IGNORE_INDEX = -100


class TokenEmbedding(nn.Embedding):
    """nn.Embedding initialized normal(0, std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 0.02, dtype=None) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)
        nn.init.normal_(self.weight, 0.0, std)


class LearnedPositions(nn.Module):
    """x + weight[:seq] for x [b, s, h]; weight [max_seq_len, h] (GPT's position_embedding)."""

    def __init__(self, max_seq_len: int, hidden_size: int, std: float = 0.02, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_seq_len, hidden_size, dtype=dtype).normal_(0.0, std))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight[: x.shape[1]]


class GPTBlock(tnn.TransformerLayer):
    """A TransformerLayer that takes only the hidden states (a pipeline passes one value between
    layers) and, with ``rope_dim`` set, makes its own RoPE angle table [rope_positions, 1, 1,
    rope_dim] (fp32, cached per device). The table covers ``rope_positions`` (GPT's max_seq_len),
    not the input's length: under sequence parallelism the layer sees a slice of the sequence
    while attention rotates the whole of it (the kernel uses the table's first seq rows)."""

    def __init__(self, *args, rope_dim: int | None = None, rope_positions: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if rope_dim is not None and (rope_positions is None or rope_positions < 1):
            raise ValueError(f"GPTBlock: rope_dim needs rope_positions >= 1 (the longest sequence); got {rope_positions!r}")
        self.rope_dim, self.rope_positions = rope_dim, rope_positions
        self._rope_cache: dict[torch.device, Tensor] = {}  # not a buffer: stays fp32 under .to(bf16)

    def forward(self, hidden_states: Tensor, **kwargs) -> Tensor:
        if self.rope_dim is not None and "rotary_pos_emb" not in kwargs:
            device = hidden_states.device
            if device not in self._rope_cache:
                rope = tnn.RotaryPositionEmbedding(self.rope_dim, device=device)
                self._rope_cache[device] = rope(self.rope_positions)
            kwargs["rotary_pos_emb"] = self._rope_cache[device]
        return super().forward(hidden_states, **kwargs)


def tied_lm_head(embedding: nn.Embedding, x: Tensor, vocab_size: int | None = None) -> Tensor:
    """logits = x @ embedding.weight.T (the LM head tied to the token embedding), the first
    ``vocab_size`` columns (None: all; GPT pads its vocabulary to a multiple of 64, and the
    padded rows are never answers, so they stay out of the softmax as in GPT.logits)."""
    logits = F.linear(x, embedding.weight)
    return logits if vocab_size is None or vocab_size == logits.shape[-1] else _first_columns(logits, vocab_size)


def _first_columns(logits: Tensor, vocab_size: int) -> Tensor:
    """logits[..., :vocab_size] as a contiguous tensor: the last stage's output must have the
    strides torch.distributed.pipelining recorded for it, and torch 2.11 records contiguous ones
    with tensor parallelism (a stride mismatch error otherwise). One copy of the logits, only where
    the vocabulary is padded."""
    return logits[..., :vocab_size].contiguous()


class LMHead(nn.Linear):
    """The untied LM head: a bias-free Linear to the padded vocabulary whose output keeps the
    first ``vocab_size`` columns (see :func:`tied_lm_head`)."""

    def __init__(self, hidden_size: int, padded_vocab: int, vocab_size: int, dtype=None) -> None:
        super().__init__(hidden_size, padded_vocab, bias=False, dtype=dtype)
        self.vocab_size = vocab_size

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        return logits if self.vocab_size == logits.shape[-1] else _first_columns(logits, self.vocab_size)


def gpt_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """GPT's loss: mean fp32 cross-entropy over positions whose label is not -100."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def _padded(vocab_size: int, multiple: int = 64) -> int:
    return -(-vocab_size // multiple) * multiple


def gpt_layer_specs(vocab_size: int, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                    intermediate_size: int | None = None, max_seq_len: int = 128, hidden_dropout: float = 0.0,
                    attention_dropout: float = 0.0, position: str = "learned", normalization: str = "LayerNorm",
                    activation: str = "gelu", tie_embeddings: bool = True, dtype: torch.dtype = torch.float32) -> list:
    """GPT's layers as specs (arguments as tachyon.train.models.GPT; the embedding padded to a
    multiple of 64 rows, the logits cut back to ``vocab_size`` columns as GPT.logits does)."""
    if position not in ("learned", "rope"):
        raise ValueError(f"gpt_layer_specs: position must be 'learned' or 'rope'; got {position!r}")
    padded = _padded(vocab_size)
    ffn = intermediate_size or 4 * hidden_size
    std, out_std = 0.02, 0.02 / math.sqrt(2.0 * num_layers)
    init = functools.partial(nn.init.normal_, mean=0.0, std=std)
    out_init = functools.partial(nn.init.normal_, mean=0.0, std=out_std)
    embed = (TiedLayerSpec("embed", TokenEmbedding, padded, hidden_size, dtype=dtype) if tie_embeddings
             else LayerSpec(TokenEmbedding, padded, hidden_size, dtype=dtype))
    layers: list = [embed]
    if position == "learned":
        layers.append(LayerSpec(LearnedPositions, max_seq_len, hidden_size, dtype=dtype))
    rope_dim = hidden_size // num_heads if position == "rope" else None
    for i in range(num_layers):
        layers.append(LayerSpec(
            GPTBlock, hidden_size, ffn, num_heads, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
            init_method=init, output_layer_init_method=out_init, layer_number=i + 1, self_attn_mask_type="causal",
            normalization=normalization, activation=activation, attn_input_format="bshd", params_dtype=dtype,
            rope_dim=rope_dim, rope_positions=max_seq_len if rope_dim is not None else None,
        ))
    norm = tnn.LayerNorm if normalization == "LayerNorm" else tnn.RMSNorm
    layers.append(LayerSpec(norm, hidden_size, dtype=dtype))
    if tie_embeddings:
        layers.append(TiedLayerSpec("embed", TokenEmbedding, padded, hidden_size, dtype=dtype,
                                    forward_fn=functools.partial(tied_lm_head, vocab_size=vocab_size)))
    else:
        layers.append(LayerSpec(LMHead, hidden_size, padded, vocab_size, dtype=dtype))
    return layers


def _key_map(num_layers: int, learned: bool, tied: bool) -> list[tuple[str, str]]:
    """(GPT prefix, pipeline prefix) pairs."""
    first_block = 2 if learned else 1
    pairs = [("token_embedding.", "tied_modules.embed." if tied else "0.")]
    if learned:
        pairs.append(("position_embedding.", "1."))
    pairs += [(f"layers.{i}.", f"{first_block + i}.") for i in range(num_layers)]
    pairs.append(("final_norm.", f"{first_block + num_layers}."))
    if not tied:
        pairs.append(("lm_head.", f"{first_block + num_layers + 1}."))
    return pairs


def gpt_state_dict_to_pipeline(state: dict[str, Tensor], num_layers: int, tied: bool | None = None) -> dict[str, Tensor]:
    """A tachyon.train.models.GPT state dict under gpt_layer_specs' PipelineModule names. tied:
    whether the LM head is the embedding (default: lm_head.weight absent or sharing its storage)."""
    learned = "position_embedding.weight" in state
    if tied is None:
        head, embedding = state.get("lm_head.weight"), state["token_embedding.weight"]
        tied = head is None or head.data_ptr() == embedding.data_ptr()
    out = {}
    pairs = _key_map(num_layers, learned, tied)
    for key, value in state.items():
        if tied and key.startswith("lm_head."):
            continue
        prefix = next((p for p in pairs if key.startswith(p[0])), None)
        if prefix is None:
            raise ValueError(f"gpt_state_dict_to_pipeline: unexpected key {key!r} (num_layers={num_layers}?)")
        out[prefix[1] + key[len(prefix[0]):]] = value
    return out


def pipeline_state_dict_to_gpt(state: dict[str, Tensor], num_layers: int, learned: bool = True) -> dict[str, Tensor]:
    """The inverse: PipelineModule names (the union over all stages) -> GPT's names (with
    ``lm_head.weight`` when the embedding is tied, as GPT's state dict has it)."""
    tied = any(k.startswith("tied_modules.embed.") for k in state)
    pairs = _key_map(num_layers, learned, tied)
    out = {}
    for key, value in state.items():
        prefix = next((p for p in pairs if key.startswith(p[1])), None)
        if prefix is None:
            raise ValueError(f"pipeline_state_dict_to_gpt: unexpected key {key!r} (num_layers={num_layers}?)")
        out[prefix[0] + key[len(prefix[1]):]] = value
    if tied:
        out["lm_head.weight"] = out["token_embedding.weight"]
    return out


__all__ = ["GPTBlock", "LMHead", "LearnedPositions", "TokenEmbedding", "gpt_layer_specs", "gpt_loss", "gpt_state_dict_to_pipeline",
           "pipeline_state_dict_to_gpt", "tied_lm_head"]
