"""build_optimizer: the ``optimizer`` config section -> a torch.optim.Optimizer.

    build_optimizer(config.optimizer, params)          # an OptimizerConfig, or {"type", "params"}

Mapping (DeepSpeed's):
- ``Adam``: FusedAdam with adam_w_mode from the params (default True, i.e. AdamW-style decay!);
  with ``torch_adam: true`` torch.optim.AdamW (adam_w_mode) or torch.optim.Adam (not).
- ``AdamW``: the same with adam_w_mode forced True.
- ``host=True`` (ZeRO-Offload: the masters live on the host): Adam / AdamW without ``torch_adam``
  build CPUAdam (DeepSpeed's DeepSpeedCPUAdam) instead of FusedAdam.
- ``Lamb``: tachyon's Lamb. ``SGD``: torch.optim.SGD.
- ``OneBitAdam`` / ``OneBitLamb``: tachyon's 1-bit optimizers (`tachyon.engine.optim.onebit`) over
  the default process group; the engine re-targets them to its data-parallel group and ZeRO
  partitions (`tachyon.engine.onebit_hooks.bind_onebit_optimizer`).
- ``ZeroOneAdam``: tachyon's 0/1 Adam (`tachyon.engine.optim.zero_one_adam`); the engine gives it
  its data-parallel group.
``torch_adam`` and ``adam_w_mode`` are consumed here, never passed on. A value that cannot be
honoured (amsgrad=True; bias_correction=False with torch_adam) raises ValueError naming the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tachyon.config import OPTIMIZER_PARAMS
from tachyon.engine.optim.adam import CPUAdam, FusedAdam
from tachyon.engine.optim.lamb import Lamb
from tachyon.engine.optim.onebit_adam import OneBitAdam
from tachyon.engine.optim.onebit_lamb import OneBitLamb
from tachyon.engine.optim.zero_one_adam import ZeroOneAdam

OPTIMIZERS = tuple(OPTIMIZER_PARAMS)
_ACCEPTED = {name: tuple(model.model_fields) for name, model in OPTIMIZER_PARAMS.items()}
"""The ``params`` keys each type takes: the config section's own models (tachyon.config.optim)."""


def _type_and_params(optimizer_config: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(optimizer_config, Mapping):
        kind, params = optimizer_config.get("type"), optimizer_config.get("params") or {}
    else:
        kind, params = getattr(optimizer_config, "type", None), getattr(optimizer_config, "params", None) or {}
    canonical = {name.lower(): name for name in OPTIMIZERS}.get(str(kind).lower()) if isinstance(kind, str) else None
    if canonical is None:
        raise ValueError(f"optimizer.type={kind!r} is not supported; allowed: {', '.join(OPTIMIZERS)}")
    if not isinstance(params, Mapping):
        raise ValueError(f"optimizer.params must be a dict; got {type(params).__name__}")
    unknown = sorted(set(params) - set(_ACCEPTED[canonical]))
    if unknown:
        raise ValueError(f"optimizer.params.{unknown[0]} is not a parameter of {canonical}; allowed: {', '.join(_ACCEPTED[canonical])}")
    return canonical, dict(params)


def build_optimizer(optimizer_config: Any, params: Iterable, *, host: bool = False) -> torch.optim.Optimizer:
    """The optimizer the config asks for over ``params`` (tensors or param-group dicts);
    ``host``: the params are ZeRO-Offload's host masters (Adam / AdamW then build CPUAdam)."""
    kind, kw = _type_and_params(optimizer_config)
    if kind == "SGD":
        return torch.optim.SGD(params, **kw)
    if kind == "Lamb":
        return Lamb(params, **kw)
    if kind in ("OneBitAdam", "OneBitLamb"):
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        return (OneBitAdam if kind == "OneBitAdam" else OneBitLamb)(params, **kw)
    if kind == "ZeroOneAdam":
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        return ZeroOneAdam(params, **kw)
    if kw.pop("amsgrad", False):
        raise ValueError("optimizer.params.amsgrad: true is not supported (the fused Adam has no AMSGrad); use false")
    torch_adam = bool(kw.pop("torch_adam", False))
    adam_w_mode = bool(kw.pop("adam_w_mode", True))
    if kind == "AdamW" and not adam_w_mode:
        raise ValueError('optimizer.params.adam_w_mode: false contradicts optimizer.type "AdamW"; use type "Adam"')
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    if not torch_adam:
        return (CPUAdam if host else FusedAdam)(params, adam_w_mode=adam_w_mode, **kw)
    if not kw.pop("bias_correction", True):
        raise ValueError("optimizer.params.bias_correction: false is not available with torch_adam: true "
                         "(torch.optim.Adam always bias-corrects); drop torch_adam or bias_correction")
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kw)
