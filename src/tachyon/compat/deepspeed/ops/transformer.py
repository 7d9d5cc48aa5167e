"""``deepspeed.ops.transformer``: the fused BERT layer = `tachyon.nn.TransformerKernelLayer`.

``DeepSpeedTransformerLayer`` is `tachyon.nn.TransformerKernelLayer` (``layer_id`` counter,
``initial_weights`` / ``initial_biases``; see docs/transformer_kernel.md).
``DeepSpeedTransformerConfig`` is `tachyon.nn.TransformerKernelConfig` with DeepSpeed's documented
signature: DeepSpeed's API has no ``max_seq_length`` (its tutorial passes one), so here it may be
left out, meaning no limit on the sequence length; everything else (fields, defaults, checks) is
tachyon's. The inference-side layer lives with the inference engine.
"""

from __future__ import annotations

import dataclasses

from tachyon.compat._names import module_getattr
from tachyon.compat.deepspeed import inference_target
from tachyon.nn import TransformerKernelConfig

NO_SEQUENCE_LIMIT = 2**31 - 1
"""``max_seq_length`` when DeepSpeed code leaves it out: the layer accepts any sequence length."""


@dataclasses.dataclass
class DeepSpeedTransformerConfig(TransformerKernelConfig):
    """`tachyon.nn.TransformerKernelConfig` where ``max_seq_length`` -1 (left out) means no limit."""

    def __post_init__(self) -> None:
        if self.max_seq_length == -1:
            self.max_seq_length = NO_SEQUENCE_LIMIT
        super().__post_init__()


def __getattr__(name: str):
    if name == "DeepSpeedTransformerLayer":
        from tachyon.nn import TransformerKernelLayer

        return TransformerKernelLayer
    return _lookup(name)


_TABLE = {
    "DeepSpeedInferenceConfig": inference_target("DeepSpeedInferenceConfig"),
    "DeepSpeedTransformerInference": inference_target("DeepSpeedTransformerInference"),
}
_lookup = module_getattr(__name__, "deepspeed.ops.transformer", _TABLE,
                         lambda: ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"])
__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
