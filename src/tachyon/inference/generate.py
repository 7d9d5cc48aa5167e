"""``engine.generate``: HF's greedy / sampling decoding over tachyon's KV cache.

Why not HF's own ``generate``: it drives the model through HF's cache objects, mask builders and
``prepare_inputs_for_generation``, whose names and contracts change between transformers releases
(5.x renamed ``past_key_values`` to ``cache``); the injected decoder keeps its own preallocated
cache. What is reused from HF is what decides the tokens: the GenerationConfig (the model's
``generation_config`` plus the call's kwargs, with HF's defaults, e.g. top_k=50 when sampling) and
HF's logits processors, applied in HF's order. The loop itself is HF's ``_sample``:

    scores = processors(ids, logits[:, -1].float())
    next   = multinomial(softmax(scores)) if do_sample else argmax(scores)
    next   = next * unfinished + pad_token_id * (1 - unfinished)      (only when an eos is set)
    stop when every row has produced an eos, or at max_length

with HF's positions for left-padded prompts (cumsum(attention_mask) - 1, pads at 0, then +1 per
step). So the same model, prompts, kwargs and torch seed give HF's tokens. Options HF has and this
loop does not (beam search, assisted decoding, stop strings, ...) are refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# generation options this loop implements; every other option must be unset or at HF's neutral default
SUPPORTED = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "use_cache", "temperature",
             "top_k", "top_p", "min_p", "repetition_penalty", "num_return_sequences", "pad_token_id", "eos_token_id",
             "bos_token_id", "decoder_start_token_id", "num_beams", "typical_p", "epsilon_cutoff", "eta_cutoff",
             "transformers_version", "return_dict_in_generate", "output_scores", "output_logits",
             "output_attentions", "output_hidden_states")
MODEL_KWARGS = ("attention_mask", "logits_processor")


def _hf_defaults() -> dict[str, Any]:
    from transformers import GenerationConfig

    getter = getattr(GenerationConfig, "_get_default_generation_params", None)
    return dict(getter()) if getter is not None else {}


def resolve_config(model_config: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(GenerationConfig, model kwargs): the model's generation config updated with ``kwargs``,
    unset fields at HF's defaults; unsupported options raise naming them."""
    from transformers import GenerationConfig

    given = kwargs.pop("generation_config", None)
    config = copy.deepcopy(given) if given is not None else GenerationConfig()
    if model_config is not None:
        config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    defaults = _hf_defaults()
    config.update(**defaults, defaults_only=True)
    model_kwargs = config.update(**kwargs)
    unknown = [k for k in model_kwargs if k not in MODEL_KWARGS]
    if unknown:
        raise ValueError(f"generate: unknown or unsupported arguments {unknown}; generation options supported: "
                         f"{', '.join(SUPPORTED)}; model inputs: input_ids, {', '.join(MODEL_KWARGS)}")
    problems = []
    for key, value in config.to_dict().items():
        if key.startswith("_") or key in SUPPORTED or value is None or value == defaults.get(key, None):
            continue
        problems.append(f"{key}={value!r}")
    checks = {"num_beams": 1, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
              "return_dict_in_generate": False, "output_scores": False, "output_logits": False,
              "output_attentions": False, "output_hidden_states": False}
    for key, neutral in checks.items():
        value = getattr(config, key, None)
        if value is not None and value != neutral and not (key.startswith("output") and not value):
            problems.append(f"{key}={value!r}")
    if problems:
        raise ValueError(f"generate: {', '.join(problems)} not supported by the injected model's generate; supported: "
                         f"greedy and multinomial sampling with {', '.join(SUPPORTED[:14])}")
    return config, model_kwargs


def _eos(config: Any, device: torch.device) -> Tensor | None:
    eos = config.eos_token_id
    if eos is None:
        return None
    return torch.tensor([eos] if isinstance(eos, int) else list(eos), dtype=torch.long, device=device)


def logits_processors(config: Any, prompt_len: int, eos: Tensor | None, attention_mask: Tensor, user: Any):
    """HF's processors for the supported options, in the order HF's ``_get_logits_processor`` builds them."""
    from transformers.generation import logits_process as lp

    processors = lp.LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(
            config.repetition_penalty, prompt_ignore_length=(attention_mask != 0).int().argmax(dim=1)))
    if config.min_length is not None and eos is not None and config.min_length > 0:
        processors.append(lp.MinLengthLogitsProcessor(config.min_length, eos, device=eos.device))
    if config.min_new_tokens is not None and eos is not None and config.min_new_tokens > 0:
        processors.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos, device=eos.device))
    if user is not None:
        processors.extend(user)
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(lp.TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(lp.TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(lp.TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
        if config.min_p is not None:
            processors.append(lp.MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return processors


def _attention_mask(input_ids: Tensor, mask: Tensor | None, config: Any, eos: Tensor | None) -> Tensor:
    """HF's default: ones, or input_ids != pad when the pad token appears and is not an eos."""
    if mask is not None:
        if tuple(mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"generate: attention_mask has shape {tuple(mask.shape)}; expected input_ids' "
                             f"{tuple(input_ids.shape)}")
        return mask.to(device=input_ids.device, dtype=torch.long)
    pad = config.pad_token_id
    if pad is not None and bool((input_ids == pad).any()) and (eos is None or not bool((eos == pad).any())):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids, dtype=torch.long)


def generate(model: Any, model_generation_config: Any, input_ids: Tensor, *, max_out_tokens: int,
             tp_group: Any = None, graphs: Any = None, **kwargs: Any) -> Tensor:
    """Token ids [batch * num_return_sequences, prompt + generated] (see the module docstring).
    ``graphs``: a cuda_graph.GraphPool that supplies the cache and replays captured decode steps."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"generate: input_ids must be an integer tensor [batch, prompt_len]; got {got}")
    config, model_kwargs = resolve_config(model_generation_config, dict(kwargs))
    input_ids = input_ids.to(device=model.device, dtype=torch.long)
    eos = _eos(config, input_ids.device)
    pad = config.pad_token_id
    if pad is None and eos is not None:
        pad = int(eos[0])  # HF: "Setting pad_token_id to eos_token_id for open-end generation"
    mask = _attention_mask(input_ids, model_kwargs.get("attention_mask"), config, eos)
    repeats = config.num_return_sequences or 1
    if repeats > 1:
        if not config.do_sample:
            raise ValueError("generate: num_return_sequences > 1 needs do_sample=True (greedy gives one answer)")
        input_ids, mask = input_ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
    batch, prompt_len = input_ids.shape
    max_length = prompt_len + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
    if max_length > max_out_tokens:
        raise ValueError(f"generate: prompt ({prompt_len}) + new tokens ({max_length - prompt_len}) = {max_length} "
                         f"exceeds max_out_tokens={max_out_tokens}, the KV cache capacity given to init_inference")
    if model.max_positions is not None and max_length > model.max_positions:
        raise ValueError(f"generate: {max_length} tokens exceed the model's {model.max_positions} positions")
    processors = logits_processors(config, prompt_len, eos, mask, model_kwargs.get("logits_processor"))
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    use_cache = config.use_cache is not False
    unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
    ids = input_ids
    graphs = graphs if use_cache else None
    cache = (graphs or model).new_cache(batch, max_length if use_cache else prompt_len)
    logits = model.step(ids, positions, cache, mask, last_only=True)[:, -1]
    while ids.shape[1] < max_length:
        scores = processors(ids, logits.float())
        if config.do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if tp_group is not None:  # every rank continues with rank 0's tokens (sampling RNGs may differ)
            dist.broadcast(next_tokens, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        if eos is not None:
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
        ids = torch.cat([ids, next_tokens[:, None]], dim=-1)
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=-1)
        if eos is not None:
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
            if not bool(unfinished.any()):
                break
        if ids.shape[1] >= max_length:
            break
        if graphs is not None:
            logits = graphs.decode(next_tokens[:, None], positions[:, -1:], cache)[:, -1]
        elif use_cache:
            logits = model.step(next_tokens[:, None], positions[:, -1:], cache, None, last_only=True)[:, -1]
        else:  # HF's use_cache=False: the whole sequence again, from an empty cache
            cache = model.new_cache(batch, ids.shape[1])
            logits = model.step(ids, positions, cache, mask, last_only=True)[:, -1]
    return ids


__all__ = ["SUPPORTED", "generate", "logits_processors", "resolve_config"]
