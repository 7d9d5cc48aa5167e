"""``deepspeed.module_inject.replace_policy``: DeepSpeed's injection policy classes as tachyon's
(`tachyon.inference.policies`), when the inference engine is there.

| DeepSpeed            | tachyon.inference.policies |
| -------------------- | -------------------------- |
| DSPolicy             | Policy (the base)          |
| HFBertLayerPolicy    | BertPolicy (BERT, RoBERTa) |
| HFGPT2LayerPolicy    | GPT2Policy                 |
| HFGPTNEOLayerPolicy  | GPTNeoPolicy               |
| HFGPTJLayerPolicy    | GPTJPolicy                 |
| LLAMALayerPolicy     | LlamaPolicy (Llama, Mistral, Qwen2) |

tachyon chooses the policy from the model's class (``init_inference(model,
replace_with_kernel_inject=True)``), so scripts rarely need these names. DeepSpeed's other
policies (GPT-NeoX, Megatron, DistilBERT, BLOOM, ...) are not implemented.
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr, unsupported

POLICIES = {
    "DSPolicy": "Policy",
    "HFBertLayerPolicy": "BertPolicy",
    "HFGPT2LayerPolicy": "GPT2Policy",
    "HFGPTNEOLayerPolicy": "GPTNeoPolicy",
    "HFGPTJLayerPolicy": "GPTJPolicy",
    "LLAMALayerPolicy": "LlamaPolicy",
}
_MISSING = ("kernel injection is not in this version of tachyon (it will be tachyon.inference); for now run "
            "the model itself under torch.no_grad()")
_OTHERS = ("GPTNEOXLayerPolicy", "MegatronLayerPolicy", "HFDistilBertLayerPolicy", "BLOOMLayerPolicy",
           "HFOPTLayerPolicy", "HFCLIPLayerPolicy")


def policy_target(name: str) -> Target:
    ours = POLICIES[name]
    return Target((("tachyon.inference.policies", ours), ("tachyon.inference.policies.base", ours)), _MISSING)


_TABLE = {name: policy_target(name) for name in POLICIES}
_TABLE.update({name: unsupported("tachyon's kernel injection has no such policy; supported: BERT/RoBERTa, GPT-2, "
                                 "GPT-Neo, GPT-J, Llama/Mistral/Qwen2 (tachyon.inference.policies)")
               for name in _OTHERS})
__getattr__ = module_getattr(__name__, "deepspeed.module_inject.replace_policy", _TABLE)
__all__ = [*_TABLE]
