"""``deepspeed.zero``: ZeRO-3's construction and gathering helpers, as they behave below stage 3.

tachyon implements ZeRO stages 0-2, where every rank holds every parameter whole. DeepSpeed's
``zero.Init`` and ``zero.GatheredParameters`` do nothing for such parameters (they act only on
ZeRO-3-partitioned ones), so here:

- ``Init(enabled=False, ...)`` is a no-op context (the usual ``enabled=stage == 3`` pattern);
  ``Init(enabled=True)`` asks for ZeRO-3 partitioned construction and raises NotImplementedError.
- ``GatheredParameters(params, modifier_rank=None, ...)`` is a no-op context: the parameters are
  already whole on every rank (a change made on one rank stays on that rank, as in DeepSpeed
  below stage 3).
- ``register_external_parameter`` does nothing (it only matters for ZeRO-3).
"""

from __future__ import annotations

import contextlib
from typing import Any

from tachyon.compat._names import module_getattr, unsupported

_ZERO3 = ("ZeRO stage 3 is not implemented by tachyon (stages 0-2 are: zero_optimization.stage); "
          "build the model normally")


class Init(contextlib.ContextDecorator):
    """DeepSpeed's ``zero.Init``: a no-op with ``enabled=False``; NotImplementedError otherwise."""

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, **kwargs: Any):
        if enabled:
            raise NotImplementedError(f"deepspeed.zero.Init(enabled=True): {_ZERO3}; pass enabled=False "
                                      "(or drop the context) below stage 3")
        del module, data_parallel_group, mem_efficient_linear, remote_device, pin_memory, config_dict_or_path
        del config, dtype, mpu, kwargs

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


class GatheredParameters(contextlib.ContextDecorator):
    """DeepSpeed's ``zero.GatheredParameters``: parameters are whole below ZeRO-3, so nothing to do."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True):
        self.params, self.modifier_rank, self.enabled = params, modifier_rank, enabled
        del fwd_module

    def __enter__(self) -> GatheredParameters:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


def register_external_parameter(module: Any, parameter: Any) -> None:
    """Does nothing below ZeRO-3 (as in DeepSpeed)."""
    del module, parameter


_TABLE = {
    "MiCS_Init": unsupported(_ZERO3),
    "TiledLinear": unsupported(_ZERO3),
    "ZeroParamStatus": unsupported(_ZERO3),
}
_OWN = ["Init", "GatheredParameters", "register_external_parameter"]
__getattr__ = module_getattr(__name__, "deepspeed.zero", _TABLE, lambda: _OWN)
__all__ = _OWN
