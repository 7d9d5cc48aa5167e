"""The two small language models ``tachyon train`` trains: a masked-LM BERT and a causal GPT.

Both take a batch from :func:`tachyon.data.collate` and return the mean cross-entropy loss, so the
training loop is ``loss = engine(**batch)``::

    model = BertMLM(vocab_size=262, hidden_size=128, num_layers=4, num_heads=4, max_seq_len=128,
                    max_batch_size=16)
    loss = model(input_ids, attention_mask, labels)       # [batch, seq] int64 each -> fp32 scalar

- :class:`BertMLM`: token + learned position embeddings (initialized with sinusoids, see
  :func:`sinusoidal_positions`) -> LayerNorm -> ``num_layers``
  :class:`~tachyon.nn.TransformerKernelLayer` (DeepSpeed's fused BERT layer, pre-LN) -> final
  LayerNorm -> transform (dense + GELU + LayerNorm, as BERT's prediction head) -> LM head, tied
  to the token embedding by default. The head runs only at the predicted positions (labels != -100):
  ~15 % of the tokens, so it costs ~15 % of a full-sequence head.
- :class:`GPT`: token embeddings (+ learned positions, or RoPE inside attention) -> ``num_layers``
  :class:`~tachyon.nn.TransformerLayer` (Transformer Engine's layer: bshd, causal) -> final
  LayerNorm -> LM head (tied by default). Labels from :class:`~tachyon.data.CausalLMDataset` are
  already shifted, so the loss is a plain token-wise cross-entropy.

Progressive layer drop: both forwards take DeepSpeed's ``progressive_layer_drop`` and
``pld_theta`` (what the engine adds to the call when the config's ``progressive_layer_drop``
section is enabled) and hand them to every layer, which knows its place in the stack
(``layer_number`` 1..L, ``num_layers`` L) and in training keeps itself with probability
``1 - (layer_number / L) * (1 - pld_theta)``. Both stacks are pre-LN, the architecture the PLD
paper needs (a skipped pre-LN layer is the identity on the residual stream). Evaluation
(``logits_at``, ``logits``, or ``eval()``) runs every layer.

Dtype: build the model in fp32 or in the training dtype (``dtype=``); the engine casts the module
to its precision (bf16/fp16) in place. The fused BERT layer checks that its inputs and parameters
have the dtype its config names, so :class:`BertMLM` must be built with the dtype it will train in.
Logits are cast to fp32 before the softmax (the loss is fp32 whatever the training dtype).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tachyon.nn as tnn
from tachyon.data import IGNORE_INDEX, padded_vocab_size

__all__ = ["GPT", "BertMLM", "count_parameters", "sinusoidal_positions"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_sizes(name: str, **sizes: int) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {key} must be an int >= 1; got {value!r}")
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise ValueError(f"{name}: hidden_size ({sizes['hidden_size']}) must be divisible by num_heads "
                         f"({sizes['num_heads']})")


def _check_dropout(name: str, **ratios: float) -> None:
    for key, value in ratios.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name}: {key} must be a number in [0, 1); got {value!r}")


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype must be one of {_DTYPES}; got {dtype!r}")


def _check_batch(name: str, input_ids: Tensor, labels: Tensor, max_seq_len: int) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"{name}: input_ids must be an int64 tensor [batch, seq]; got {got}")
    if not isinstance(labels, Tensor) or labels.shape != input_ids.shape:
        got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"{name}: labels must have the shape of input_ids {tuple(input_ids.shape)}; got {got}")
    if input_ids.shape[1] > max_seq_len:
        raise ValueError(f"{name}: sequence length {input_ids.shape[1]} exceeds max_seq_len={max_seq_len}")


def sinusoidal_positions(rows: int, dim: int, std: float) -> Tensor:
    """fp32 [rows, dim] sinusoidal position codes (Vaswani et al. 2017: sin on even, cos on odd
    dims, wavelengths 2*pi .. 10000*2*pi), scaled to root-mean-square ``std`` (each sin/cos pair has sin^2 + cos^2 = 1).

    Used as the *initial value* of the learned position tables: with random N(0, std) rows,
    attention has no notion of "neighbour" at first and a small masked LM sits on the unigram
    plateau (loss ~3.3 on bytes) for a long time; sinusoids give every offset a linear signature
    from step one, so the plateau breaks early. The table is still trained."""
    position = torch.arange(rows, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(rows, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return (table * (std * math.sqrt(2.0))).float()  # sin/cos have root mean square 1/sqrt(2)


def _padded_bias(bias: Tensor, vocab_size: int, padded_vocab: int) -> Tensor:
    if not isinstance(bias, Tensor) or bias.shape != (vocab_size,) or not bias.is_floating_point():
        got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, Tensor) else type(bias).__name__
        raise ValueError(f"output_bias must be a float tensor [vocab_size={vocab_size}]; got {got}")
    padded = torch.full((padded_vocab,), float(bias.min()), dtype=torch.float32)
    padded[:vocab_size] = bias.float()
    return padded


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


class BertMLM(nn.Module):
    """A small BERT for masked-LM pre-training, built from tachyon's fused transformer kernel layer.

    Args:
        vocab_size: embedding rows (the tokenizer's ``vocab_size``; padded to a multiple of 64
            internally, the padded rows are never targets).
        hidden_size, num_layers, num_heads, intermediate_size (None: 4 * hidden): sizes.
        max_seq_len: the longest sequence (position table rows, the kernel's max_seq_length).
        max_batch_size: the largest micro-batch (the kernel layer's ``batch_size``).
        hidden_dropout, attention_dropout: the kernel layer's dropout ratios (also applied to the
            embeddings' output).
        tie_embeddings: the LM head reuses the token embedding matrix.
        dtype: parameter dtype (fp32, bf16 or fp16): the dtype the model trains in.
        seed: the kernel layers' dropout seed (layer ``i`` hashes it with its layer id).
        kernel_flags: extra :class:`~tachyon.nn.TransformerKernelConfig` fields (e.g.
            ``normalize_invertible``, ``gelu_checkpoint``, ``attn_dropout_checkpoint``).
        initializer_range: std of the kernel layers' weight init (DeepSpeed/BERT: 0.02).
        output_bias: initial LM-head bias, fp32 ``[vocab_size]`` (None: zeros). ``tachyon train``
            passes the log unigram frequencies of the training tokens, so the model starts at the
            context-free loss and every step goes into learning from the context; the padded
            rows get the smallest given value.

    forward(input_ids [b, s] int64, attention_mask [b, s] 0/1 or None, labels [b, s] int64 with
    -100 at unscored positions, progressive_layer_drop=False, pld_theta=None) -> mean
    cross-entropy (fp32 scalar) over the scored positions.
    Saved for backward: what the kernel layers save (see TransformerKernelLayer) plus the
    embeddings' and the head's inputs.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_size: int | None = None,
        max_seq_len: int = 128,
        max_batch_size: int = 64,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        tie_embeddings: bool = True,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        kernel_flags: dict | None = None,
        initializer_range: float = 0.02,
        output_bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        intermediate_size = intermediate_size or 4 * hidden_size
        _check_sizes("BertMLM", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                     num_heads=num_heads, intermediate_size=intermediate_size, max_seq_len=max_seq_len,
                     max_batch_size=max_batch_size)
        _check_dropout("BertMLM", hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)
        _check_dtype("BertMLM", dtype)
        self.vocab_size, self.max_seq_len, self.hidden_size = vocab_size, max_seq_len, hidden_size
        padded_vocab = padded_vocab_size(vocab_size)
        std = 0.02
        self.token_embedding = nn.Embedding(padded_vocab, hidden_size, dtype=dtype)
        self.position_embedding = nn.Embedding(max_seq_len, hidden_size, dtype=dtype)
        self.embedding_norm = tnn.LayerNorm(hidden_size, eps=1e-12, dtype=dtype)
        self.embedding_dropout = hidden_dropout
        config = tnn.TransformerKernelConfig(
            batch_size=max_batch_size, max_seq_length=max_seq_len, hidden_size=hidden_size,
            intermediate_size=intermediate_size, heads=num_heads, attn_dropout_ratio=attention_dropout,
            hidden_dropout_ratio=hidden_dropout, num_hidden_layers=num_layers, initializer_range=initializer_range,
            seed=seed, fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, pre_layer_norm=True,
            **(kernel_flags or {}),
        )
        self.layers = nn.ModuleList(tnn.TransformerKernelLayer(config) for _ in range(num_layers))
        for number, layer in enumerate(self.layers, 1):  # each layer's place, for progressive layer drop
            layer.layer_number, layer.num_layers = number, num_layers
        self.final_norm = tnn.LayerNorm(hidden_size, eps=1e-12, dtype=dtype)
        # BERT's prediction head transform: dense -> GELU -> LayerNorm, then the decoder
        self.transform = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        self.transform_norm = tnn.LayerNorm(hidden_size, eps=1e-12, dtype=dtype)
        self.lm_head = nn.Linear(hidden_size, padded_vocab, bias=False, dtype=dtype)
        self.lm_bias = nn.Parameter(torch.zeros(padded_vocab, dtype=dtype))
        with torch.no_grad():
            for module in (self.token_embedding, self.transform):
                module.weight.normal_(0.0, std)
            self.position_embedding.weight.copy_(sinusoidal_positions(max_seq_len, hidden_size, std))
            self.transform.bias.zero_()
            if output_bias is not None:
                self.lm_bias.copy_(_padded_bias(output_bias, vocab_size, padded_vocab))
            if not tie_embeddings:
                self.lm_head.weight.normal_(0.0, std)
        if tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                progressive_layer_drop: bool = False, pld_theta: float | None = None) -> Tensor:
        if labels is None:
            raise ValueError("BertMLM: labels are required (the model returns the masked-LM loss)")
        _check_batch("BertMLM", input_ids, labels, self.max_seq_len)
        scored = labels != IGNORE_INDEX
        logits = self.logits_at(input_ids, scored, attention_mask, progressive_layer_drop=progressive_layer_drop,
                                pld_theta=pld_theta)
        return F.cross_entropy(logits, labels[scored])

    def logits_at(self, input_ids: Tensor, scored: Tensor, attention_mask: Tensor | None = None,
                  progressive_layer_drop: bool = False, pld_theta: float | None = None) -> Tensor:
        """fp32 logits ``[n, vocab_size]`` at the ``n`` positions where ``scored`` ([b, s] bool) is
        True, in row-major order (what fill-mask reads; the loss is their cross-entropy).
        ``progressive_layer_drop``, ``pld_theta``: passed to every layer (module docstring)."""
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        x = self.embedding_norm(x)
        if self.embedding_dropout > 0 and self.training:
            x = F.dropout(x, self.embedding_dropout)
        # all-ones masks (full windows, the datasets' case) are dropped: no key bias to add
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        for layer in self.layers:
            x = layer(x, mask, progressive_layer_drop=progressive_layer_drop, pld_theta=pld_theta)
        h = self.final_norm(x[scored])  # [n_scored, hidden]: the head only runs where a label is
        h = self.transform_norm(F.gelu(self.transform(h)))
        logits = self.lm_head(h) + self.lm_bias
        return logits.float()[:, :self.vocab_size]  # the padded rows are never answers


class GPT(nn.Module):
    """A small GPT (decoder-only LM) built from Transformer-Engine-style ``tachyon.nn.TransformerLayer``.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size (None: 4 * hidden),
        max_seq_len: sizes (vocab padded to a multiple of 64 internally).
        hidden_dropout, attention_dropout: the layers' dropout ratios.
        position: "learned" (a position table added to the token embeddings, GPT-2) or "rope"
            (rotary embeddings applied to queries and keys in every layer).
        normalization: "LayerNorm" or "RMSNorm"; activation: any TransformerLayer activation
            ("gelu", "swiglu", ...).
        tie_embeddings: the LM head reuses the token embedding matrix.
        dtype: parameter dtype.

    forward(input_ids [b, s] int64, attention_mask ignored (causal, windows are full),
    labels [b, s] int64 already shifted, -100 = unscored, progressive_layer_drop=False,
    pld_theta=None) -> mean cross-entropy (fp32 scalar).
    Saved for backward: what the TransformerLayers save plus the head's input.
    """

    POSITIONS = ("learned", "rope")

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        intermediate_size: int | None = None,
        max_seq_len: int = 128,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        position: str = "learned",
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        tie_embeddings: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        intermediate_size = intermediate_size or 4 * hidden_size
        _check_sizes("GPT", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                     num_heads=num_heads, intermediate_size=intermediate_size, max_seq_len=max_seq_len)
        _check_dropout("GPT", hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)
        _check_dtype("GPT", dtype)
        if position not in self.POSITIONS:
            raise ValueError(f"GPT: position must be one of {self.POSITIONS}; got {position!r}")
        self.vocab_size, self.max_seq_len, self.position = vocab_size, max_seq_len, position
        padded_vocab = padded_vocab_size(vocab_size)
        std = 0.02
        out_std = std / math.sqrt(2.0 * num_layers)  # GPT-2's scaled init of the residual projections

        def init(weight: Tensor) -> None:
            nn.init.normal_(weight, 0.0, std)

        def out_init(weight: Tensor) -> None:
            nn.init.normal_(weight, 0.0, out_std)

        self.token_embedding = nn.Embedding(padded_vocab, hidden_size, dtype=dtype)
        nn.init.normal_(self.token_embedding.weight, 0.0, std)
        if position == "learned":
            self.position_embedding = nn.Embedding(max_seq_len, hidden_size, dtype=dtype)
            with torch.no_grad():
                self.position_embedding.weight.copy_(sinusoidal_positions(max_seq_len, hidden_size, std))
        else:
            self.position_embedding = None
        self.head_dim = hidden_size // num_heads
        self._rope_cache: dict[tuple[torch.device, int], Tensor] = {}  # not a buffer: stays fp32 under .to(bf16)
        self.layers = nn.ModuleList(
            tnn.TransformerLayer(
                hidden_size, intermediate_size, num_heads, hidden_dropout=hidden_dropout,
                attention_dropout=attention_dropout, init_method=init, output_layer_init_method=out_init,
                layer_number=i + 1, num_layers=num_layers, self_attn_mask_type="causal",
                normalization=normalization, activation=activation, attn_input_format="bshd", params_dtype=dtype,
            )
            for i in range(num_layers)
        )
        norm = tnn.LayerNorm if normalization == "LayerNorm" else tnn.RMSNorm
        self.final_norm = norm(hidden_size, dtype=dtype)
        self.lm_head = nn.Linear(hidden_size, padded_vocab, bias=False, dtype=dtype)
        if tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        else:
            nn.init.normal_(self.lm_head.weight, 0.0, std)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                progressive_layer_drop: bool = False, pld_theta: float | None = None) -> Tensor:
        del attention_mask  # causal attention over full windows; padding never occurs in these datasets
        if labels is None:
            raise ValueError("GPT: labels are required (the model returns the language-model loss)")
        _check_batch("GPT", input_ids, labels, self.max_seq_len)
        logits = self.logits(input_ids, progressive_layer_drop=progressive_layer_drop, pld_theta=pld_theta)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def logits(self, input_ids: Tensor, progressive_layer_drop: bool = False, pld_theta: float | None = None) -> Tensor:
        """fp32 next-token logits ``[b, s, vocab_size]`` (what generation samples from).
        ``progressive_layer_drop``, ``pld_theta``: passed to every layer (module docstring)."""
        seq = input_ids.shape[1]
        x = self.token_embedding(input_ids)
        rotary = None
        if self.position_embedding is not None:
            x = x + self.position_embedding(torch.arange(seq, device=input_ids.device))
        else:
            key = (input_ids.device, seq)
            if key not in self._rope_cache:
                rope = tnn.RotaryPositionEmbedding(self.head_dim, device=input_ids.device)
                self._rope_cache[key] = rope(seq)  # fp32 angles [seq, 1, 1, head_dim]
            rotary = self._rope_cache[key]
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=rotary, progressive_layer_drop=progressive_layer_drop, pld_theta=pld_theta)
        return self.lm_head(self.final_norm(x)).float()[..., :self.vocab_size]  # padded rows are never answers
