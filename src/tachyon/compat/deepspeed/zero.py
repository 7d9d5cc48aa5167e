"""``deepspeed.zero``: ZeRO-3's construction and gathering helpers, over `tachyon.zero`.

- ``Init(...)``: DeepSpeed's signature over `tachyon.zero.Init`: the model is built one unit at
  a time and each rank keeps only its shard of every parameter; ``tachyon.initialize`` with
  ``zero_optimization.stage: 3`` allocates just those shards. ``config_dict_or_path`` / ``config``
  give the units (``zero_optimization.shard_module_classes``); ``mpu`` /
  ``data_parallel_group`` the group the shards are for; ``module`` (an already built model) is
  sharded at once; ``enabled=False`` does nothing (the usual ``enabled=stage == 3`` pattern).
  ``remote_device="nvme"`` is refused (host memory only); ``dtype`` is accepted and not applied
  here (the engine casts to the config's precision); ``pin_memory`` and
  ``mem_efficient_linear`` have no counterpart and are ignored.
- ``GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``: whole
  parameters inside the block (`tachyon.zero.GatheredParameters`); parameters that are whole
  anyway (stages 0-2) are left alone, so a change made on one rank stays on that rank, as in
  DeepSpeed below stage 3.
- ``register_external_parameter(module, parameter)``: `tachyon.zero.register_external_parameter`.
"""

from __future__ import annotations

from typing import Any

from tachyon import zero as _zero
from tachyon.compat._names import module_getattr, unsupported

GatheredParameters = _zero.GatheredParameters
register_external_parameter = _zero.register_external_parameter


class Init(_zero.Init):
    """DeepSpeed's ``zero.Init`` (module docstring)."""

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, **kwargs: Any):
        del mem_efficient_linear, pin_memory, dtype, kwargs
        if remote_device is not None and str(remote_device).lower() == "nvme":
            raise ValueError('deepspeed.zero.Init(remote_device="nvme"): NVMe offload is not supported by tachyon; '
                             'use remote_device="cpu" or None')
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        super().__init__(data_parallel_group=data_parallel_group, config=config_dict_or_path or config,
                         enabled=enabled)
        if enabled and module is not None:
            with self:
                pass
            _zero.shard_parameters(module, self.rank, self.world, self.group)


_ZERO3 = "a DeepSpeed ZeRO-3 internal with no counterpart on FSDP2 (tachyon's stage 3)"
_TABLE = {
    "MiCS_Init": unsupported("MiCS is not implemented by tachyon"),
    "TiledLinear": unsupported(_ZERO3),
    "ZeroParamStatus": unsupported(_ZERO3),
}
_OWN = ["Init", "GatheredParameters", "register_external_parameter"]
__getattr__ = module_getattr(__name__, "deepspeed.zero", _TABLE, lambda: _OWN)
__all__ = _OWN
