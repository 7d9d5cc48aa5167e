"""The inference engine: DeepSpeed-Inference's ``init_inference`` on tachyon's kernels.

    engine = tachyon.init_inference(model, dtype=torch.float16, tensor_parallel={"tp_size": 2})
    logits = engine(input_ids).logits
    tokens = engine.generate(input_ids, attention_mask=mask, max_new_tokens=64)

- Kernel injection (default): policies for HF BERT/RoBERTa, GPT-2, GPT-Neo, GPT-J and
  Llama/Mistral/Qwen2, chosen from the model class; a model a policy cannot convert exactly is
  refused naming what is supported (tachyon.inference.policies).
- Tensor slicing over ``tp_size`` ranks: heads and MLP columns split, one all-reduce per attention
  and per MLP block (tachyon.inference.weights, tensor_parallel); ``injection_policy`` slices the
  HF model's own layers without kernel injection.
- A preallocated KV cache with a prefill and a decode path (tachyon.inference.decoder,
  kernels/decode_attention, kernels/kv_append); ``engine.generate`` decodes like HF's generate.
- INT8 weight-only (dtype=torch.int8 or ``quant``; kernels/int8_linear) and MoQ
  quantization-aware training (tachyon.inference.moq) whose weights the INT8 path loads exactly.
"""

from tachyon.inference.config import InferenceConfig, build_config
from tachyon.inference.engine import InferenceEngine
from tachyon.inference.inject import init_inference

__all__ = ["InferenceConfig", "InferenceEngine", "build_config", "init_inference"]
