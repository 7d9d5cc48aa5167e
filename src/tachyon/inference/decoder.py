"""The injected decoder: embeddings -> DecoderLayers -> final norm -> LM head, with a preallocated
KV cache. It replaces the HF decoder's forward (the HF module keeps its config and generation
config; its weights were copied, sliced for this rank, and possibly quantized).

A step runs s new tokens of every sequence through all layers:

    input_ids [batch, s], positions [batch, s]     (HF's position_ids; with left padding they differ per row)
    cache.past                                     slots already filled (the same for every row)
    attention_mask [batch, s] (1 = token, 0 = pad) marks padding slots -inf in cache.bias for good

and returns logits [batch, s or 1, vocab] (or hidden states for a base model); vocab is the
weights' ``vocab_size`` when set (the LM head's first rows; tachyon's GPT pads its embedding). Prefill is one
step over the whole prompt (flash attention over the new keys), decode one step per token
(decode_attention over the cache).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tachyon.inference.config import WeightQuant
from tachyon.inference.layers import DecoderLayer, InferenceNorm, StepState
from tachyon.inference.weights import DecoderWeights


class KVCache:
    """K and V of every layer, preallocated: storage [layers, 2, batch, kv_heads, capacity, head_dim].

    ``lengths`` (int32 [batch], on the device) and ``past`` (host int) count the filled slots;
    ``bias`` (fp32 [batch, capacity]) is 0 for real tokens and -inf for padding slots. Zero-filled,
    so slots never written hold finite values."""

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.storage = torch.zeros((layers, 2, batch, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.bias = torch.zeros((batch, capacity), dtype=torch.float32, device=device)
        self.past, self.capacity, self.has_padding = 0, capacity, False

    def reset(self) -> None:
        """Empty the cache for a new batch of prompts (the storage is reused as it is)."""
        self.lengths.zero_()
        self.bias.zero_()
        self.past, self.has_padding = 0, False

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        return self.storage[index, 0], self.storage[index, 1]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


class InjectedDecoder(nn.Module):
    """A decoder-only model rebuilt from tachyon's inference layers (see the module docstring)."""

    def __init__(self, w: DecoderWeights, *, group: Any, dtype: torch.dtype, device: torch.device,
                 quant: WeightQuant | None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = w.heads, w.kv_heads, w.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_positions = w.max_positions

        def param(t: Tensor | None) -> nn.Parameter | None:
            return None if t is None else nn.Parameter(t.detach().to(device=device, dtype=dtype), requires_grad=False)

        self.embed = param(w.embed)
        self.pos_embed = param(w.pos_embed)
        self.layers = nn.ModuleList(DecoderLayer(layer, w.heads, w.kv_heads, w.head_dim, group=group, dtype=dtype,
                                                 device=device, quant=quant) for layer in w.layers)
        self.final_norm = InferenceNorm(w.final_norm, dtype, device)
        tied = w.lm_head is not None and w.lm_head.data_ptr() == w.embed.data_ptr() and w.lm_head.shape == w.embed.shape
        self.lm_head = self.embed if tied else param(w.lm_head)
        self.lm_head_bias = param(w.lm_head_bias)
        # the head's rows past vocab_size (an embedding padded to a multiple of 64) never produce a logit
        self.vocab_size = w.vocab_size
        self.rotary_interleaved = False
        if w.rotary is not None:
            self.register_buffer("rope_cos", w.rotary.cos.to(device=device, dtype=torch.float32).contiguous())
            self.register_buffer("rope_sin", w.rotary.sin.to(device=device, dtype=torch.float32).contiguous())
            self.rotary_interleaved = w.rotary.interleaved
        else:
            self.rope_cos = self.rope_sin = None

    @property
    def is_lm(self) -> bool:
        return self.lm_head is not None

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(len(self.layers), batch, self.kv_heads, capacity, self.head_dim, self.dtype, self.device)

    def step(self, input_ids: Tensor, positions: Tensor, cache: KVCache, attention_mask: Tensor | None = None,
             last_only: bool = False) -> Tensor:
        """Run ``input_ids`` [batch, s] at ``positions`` [batch, s] through the model, appending to
        ``cache``; returns logits [batch, s (1 if last_only), vocab] (hidden states for a base model)."""
        seq = input_ids.shape[1]
        past = cache.past
        if past + seq > cache.capacity:
            raise ValueError(f"the KV cache holds {cache.capacity} tokens; {past} are used and {seq} more do not fit")
        if attention_mask is not None:
            pad = attention_mask[:, -seq:] == 0
            if bool(pad.any()):
                cache.bias[:, past:past + seq].masked_fill_(pad, float("-inf"))
                cache.has_padding = True
        out = self.run(input_ids, positions, cache, last_only)
        cache.past += seq
        return out

    def run(self, input_ids: Tensor, positions: Tensor, cache: KVCache, last_only: bool) -> Tensor:
        """The device work of :meth:`step`: no host reads, so a decode step can be captured in a CUDA
        graph (cache.past, a host int, only selects the prefill or the decode attention path)."""
        seq = input_ids.shape[1]
        x = F.embedding(input_ids, self.embed)
        # learned positions: added inside the first layer's norm (its residual input), not by an add
        pos = None if self.pos_embed is None else F.embedding(positions, self.pos_embed)
        rotary = None if self.rope_cos is None else (self.rope_cos, self.rope_sin, self.rotary_interleaved)
        state = StepState(positions=positions, lengths_before=cache.lengths, lengths_after=cache.lengths + seq,
                          past=cache.past, bias=cache.bias if cache.has_padding else None, rotary=rotary)
        delta, residual = x, pos
        for index, layer in enumerate(self.layers):
            delta, residual = layer(delta, residual, *cache.layer(index), state)
        cache.lengths.add_(seq)
        if last_only:
            delta, residual = delta[:, -1:], residual[:, -1:]
        hidden, _ = self.final_norm(delta, residual)
        if self.lm_head is None:
            return hidden
        head, head_bias = self.lm_head, self.lm_head_bias
        if self.vocab_size is not None:
            head = head[:self.vocab_size]
            head_bias = None if head_bias is None else head_bias[:self.vocab_size]
        return F.linear(hidden, head, head_bias)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights one decode step reads: the layers' GEMM weights (+ INT8 scales), the
        norms, and the LM head (the embedding rows read are negligible)."""
        gemm = sum(m.weight_bytes() for m in self.modules() if hasattr(m, "weight_bytes") and m is not self)
        norms = sum(p.numel() * p.element_size() for n, p in self.named_parameters() if "ln" in n or "norm" in n)
        rows = 0 if self.lm_head is None else min(self.lm_head.shape[0], self.vocab_size or self.lm_head.shape[0])
        head = 0 if self.lm_head is None else rows * self.lm_head.shape[1] * self.lm_head.element_size()
        return {"layers_gemm": gemm, "norms": norms, "lm_head": head, "total": gemm + norms + head}
