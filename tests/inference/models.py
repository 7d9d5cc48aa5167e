"""Tiny random HF models for the inference tests, built the same way in every process (seeded),
and the prompts they run: a left-padded batch of three prompts of different lengths."""

from __future__ import annotations

import torch

VOCAB = 96
EOS = 2


def _configs():
    import transformers as T

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    llama = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=160, **common)
    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=160, **common)),
        "gpt_neo": (T.GPTNeoForCausalLM, T.GPTNeoConfig(hidden_size=64, num_layers=2, num_heads=4,
                                                        max_position_embeddings=160, window_size=8,
                                                        attention_types=[[["global", "local"], 1]], **common)),
        "gptj": (T.GPTJForCausalLM, T.GPTJConfig(n_embd=64, n_layer=2, n_head=4, n_positions=160, rotary_dim=8, **common)),
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(num_key_value_heads=2, **llama)),
        "mistral": (T.MistralForCausalLM, T.MistralConfig(num_key_value_heads=2, sliding_window=12, **llama)),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **llama)),
        "bert": (T.BertModel, T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=96, max_position_embeddings=64)),
    }


def make_model(name: str, seed: int = 0, init_std: float | None = None):
    """A small random HF model in eval mode. ``init_std`` rescales every weight matrix to that
    standard deviation (peakier logits than HF's 0.02 init: tokens are not decided by rounding)."""
    from transformers import logging

    logging.set_verbosity_error()
    cls, config = _configs()[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init_std)
    return model


def prompts(batch_lengths=(9, 4, 6), seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): prompts of the given lengths (ids 3..vocab-1), left-padded with token 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(batch_lengths)
    ids = torch.zeros(len(batch_lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(batch_lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


DECODERS = ("gpt2", "gpt_neo", "gptj", "llama", "mistral", "qwen2")
