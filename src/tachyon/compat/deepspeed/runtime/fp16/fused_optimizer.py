"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, a DeepSpeed optimizer wrapper tachyon does not have."""

from __future__ import annotations

from tachyon.compat._names import module_getattr, unsupported

_TABLE = {
    "FP16_Optimizer": unsupported("DeepSpeed's fp16 / bf16 optimizer wrapper is not a tachyon class: the engine applies loss "
                        "scaling and fp32 masters outside the optimizer, and engine.optimizer is the torch optimizer "
                        "itself (engine.optimizer.optimizer is the same object); check engine.fp16_enabled() / "
                        "engine.bfloat16_enabled() instead"),
}
__getattr__ = module_getattr(__name__, "deepspeed.runtime.fp16.fused_optimizer", _TABLE, lambda: [])
__all__: list[str] = []
