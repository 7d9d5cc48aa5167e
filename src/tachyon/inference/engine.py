"""InferenceEngine: what ``tachyon.init_inference`` returns; it calls like the HF model it wraps.

    engine = tachyon.init_inference(model, dtype=torch.float16)
    out = engine(input_ids, attention_mask=mask)            # the HF model's output type
    ids = engine.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=True, top_p=0.9)

Three kinds of engine, by what init_inference did to the model:

- "decoder" (kernel injection of GPT-2 / GPT-Neo / GPT-J / Llama-style / tachyon's GPT):
  ``engine.module`` is an :class:`InjectedDecoder`; forward returns ``CausalLMOutputWithPast``
  (logits, and a loss with ``labels``) or, for a base model, ``BaseModelOutputWithPast``; generate
  runs tachyon's KV cache. A model without an HF ``generation_config`` (tachyon's GPT) generates
  from HF's ``GenerationConfig()`` defaults: no eos or pad id unless the call passes them.
- "encoder" (BERT / RoBERTa): ``engine.module`` is the HF model with its layers replaced; forward
  and everything else are HF's.
- "hf" (no kernel injection: dtype only, or tensor slicing alone with ``injection_policy``):
  ``engine.module`` is the HF model; forward and generate are HF's own.

The engine is only an orchestrator: the work is in decoder.py, generate.py and the layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tachyon.inference.config import InferenceConfig
from tachyon.inference.decoder import InjectedDecoder
from tachyon.inference.generate import generate as _generate

# forward arguments of an HF causal LM that the injected decoder honours or that change nothing
_FORWARD_NEUTRAL = {"use_cache": None, "return_dict": None, "output_attentions": False,
                    "output_hidden_states": False, "cache": None, "past_key_values": None, "logits_to_keep": 0}


class InferenceEngine(nn.Module):
    """See the module docstring. ``hf_model``: the user's model (its config, generation_config)."""

    def __init__(self, module: nn.Module, config: InferenceConfig, *, kind: str, hf_model: nn.Module,
                 tp_group: Any = None, policy: str | None = None) -> None:
        super().__init__()
        self.module = module
        self._config = config
        self.kind = kind
        self.policy = policy
        self.tp_group = tp_group
        self.hf_config = getattr(hf_model, "config", None)
        self.generation_config = getattr(hf_model, "generation_config", None)
        self._hf_model = [hf_model]  # not a submodule: its layers were copied, not to be moved or counted
        self._graphs = None
        if config.enable_cuda_graph:
            if kind != "decoder":
                raise ValueError("enable_cuda_graph=True captures the decode step of a kernel-injected decoder "
                                 f"(GPT-2, GPT-Neo, GPT-J, Llama-style, tachyon GPT); this engine is {kind!r}")
            from tachyon.inference.cuda_graph import GraphPool

            self._graphs = GraphPool(module, config.max_out_tokens)

    @property
    def config(self) -> InferenceConfig:
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        return self._config.dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            if self.kind != "decoder":
                return self.module(*args, **kwargs)
            return self._decoder_forward(*args, **kwargs)

    def _decoder_forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                         position_ids: Tensor | None = None, labels: Tensor | None = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

        for key, value in kwargs.items():
            if key not in _FORWARD_NEUTRAL or (value is not None and value is not False and value != 0
                                               and key not in ("use_cache", "return_dict")):
                raise ValueError(f"the injected {self.policy} model's forward takes input_ids, attention_mask, "
                                 f"position_ids, labels (and ignores {', '.join(_FORWARD_NEUTRAL)} at their "
                                 f"defaults); got {key}={value!r}")
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [batch, seq] integer tensor; got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
        model: InjectedDecoder = self.module
        input_ids = input_ids.to(model.device)
        batch, seq = input_ids.shape
        if position_ids is None:  # HF's forward: 0..seq-1 whatever the padding (generate passes its own)
            position_ids = torch.arange(seq, device=model.device).expand(batch, seq)
        if attention_mask is not None:
            attention_mask = attention_mask.to(model.device)
        cache = model.new_cache(batch, seq)
        out = model.step(input_ids, position_ids.to(model.device, torch.long), cache, attention_mask)
        if not model.is_lm:
            return BaseModelOutputWithPast(last_hidden_state=out)
        loss = None
        if labels is not None:  # HF's causal-LM loss: shifted labels, -100 ignored, mean over tokens
            logits = out.float()[:, :-1].reshape(-1, out.shape[-1])
            loss = F.cross_entropy(logits, labels.to(model.device)[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=out)

    def generate(self, input_ids: Tensor | None = None, **kwargs: Any) -> Tensor:
        """HF's generate: same kwargs, same tokens (see tachyon.inference.generate)."""
        if self.kind == "encoder":
            raise ValueError(f"{type(self._hf_model[0]).__name__} is an encoder; generate needs a causal LM "
                             "(GPT-2, GPT-Neo, GPT-J, Llama-style, tachyon GPT)")
        if self.kind == "hf":
            return self.module.generate(input_ids, **kwargs)
        if not self.module.is_lm:
            raise ValueError(f"{type(self._hf_model[0]).__name__} has no LM head; generate needs a *ForCausalLM / "
                             "*LMHeadModel")
        if input_ids is None:
            raise ValueError("generate: input_ids is required")
        with torch.no_grad():
            return _generate(self.module, self.generation_config, input_ids, max_out_tokens=self._config.max_out_tokens,
                             tp_group=self.tp_group, graphs=self._graphs, **kwargs)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights this rank holds in the injected layers (and what one decode step reads)."""
        if self.kind == "decoder":
            return self.module.weight_bytes()
        total = sum(m.weight_bytes() for m in self.module.modules() if hasattr(m, "weight_bytes"))
        return {"layers_gemm": total, "total": total}

    def extra_repr(self) -> str:
        c = self._config
        return (f"kind={self.kind}, policy={self.policy}, dtype={c.dtype}, tp_size={c.tp_size}, "
                f"int8={c.int8}, max_out_tokens={c.max_out_tokens}")


__all__ = ["InferenceEngine"]
