"""Flash attention (causal, key padding bias, GQA/MQA, Philox dropout): reference, Triton kernels, op."""

from tachyon.kernels.attention.op import attention
from tachyon.kernels.attention.packed import attention_qkvpacked
from tachyon.kernels.attention.reference import attention_reference, padding_bias_from_mask, sdpa_attention

__all__ = ["attention", "attention_qkvpacked", "attention_reference", "padding_bias_from_mask", "sdpa_attention"]
