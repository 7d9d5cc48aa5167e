"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 / bf16 optimizer wrappers, which tachyon does not
have: the engine keeps precision (loss scaling, fp32 masters) outside the optimizer, and
``engine.optimizer`` is the torch optimizer itself (docs/compat.md). The names import; any use,
``isinstance`` included, raises NotImplementedError saying so."""

from __future__ import annotations

from tachyon.compat._names import module_getattr

_SUBMODULES = ("fused_optimizer", "onebit", "unfused_optimizer")
__getattr__ = module_getattr(__name__, "deepspeed.runtime.fp16", {}, submodules=_SUBMODULES)


__all__ = list(_SUBMODULES)
