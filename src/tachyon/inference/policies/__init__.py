"""Kernel-injection policies, chosen from the model's class.

    policy = policy_for(model)          # ValueError listing the supported classes otherwise

| policy | HF classes | what is converted |
| --- | --- | --- |
| BERT/RoBERTa | Bert*/Roberta* (Model, ForMaskedLM, ForSequenceClassification, ...) | encoder layers (post-LN) |
| GPT-2 | GPT2Model, GPT2LMHeadModel | whole decoder, KV cache |
| GPT-Neo | GPTNeoModel, GPTNeoForCausalLM | whole decoder (local layers: sliding window) |
| GPT-J | GPTJModel, GPTJForCausalLM | whole decoder (interleaved partial rotary, parallel block) |
| Llama-style | Llama*, Mistral*, Qwen2* (Model, ForCausalLM) | whole decoder (RoPE, GQA, RMSNorm, SwiGLU, windows) |
| tachyon GPT | tachyon.train.models.GPT (no HF config) | whole decoder (learned positions / RoPE, vocab_size logits) |
"""

from __future__ import annotations

from torch import nn

from tachyon.inference.policies.base import Policy
from tachyon.inference.policies.bert import BertPolicy
from tachyon.inference.policies.gpt import GPT2Policy, GPTJPolicy, GPTNeoPolicy
from tachyon.inference.policies.llama import LlamaPolicy
from tachyon.inference.policies.tachyon import TachyonGPTPolicy

POLICIES: tuple[type[Policy], ...] = (BertPolicy, GPT2Policy, GPTNeoPolicy, GPTJPolicy, LlamaPolicy, TachyonGPTPolicy)


def supported_classes() -> list[str]:
    return [name for policy in POLICIES for name in policy.model_classes]


def policy_for(model: nn.Module) -> Policy:
    """The policy that converts ``model`` (by its class), or a ValueError listing what is supported."""
    for policy in POLICIES:
        if policy.matches(model):
            return policy(model)
    raise ValueError(
        f"kernel injection does not support {type(model).__name__}; supported model classes: "
        f"{', '.join(supported_classes())}. For tensor slicing alone pass "
        "injection_policy={LayerClass: ('<row-parallel linear>', ...)} with replace_with_kernel_inject=False"
    )


__all__ = ["POLICIES", "Policy", "policy_for", "supported_classes"]
