"""The ``optimizer`` and ``scheduler`` sections: a ``type`` plus ``params`` checked per type.

Types match case-insensitively and are stored under their canonical name. After checking,
``params`` holds every parameter of the type with DeepSpeed's default filled in, so the engine
can build the optimizer or schedule from it without defaults of its own. DeepSpeed semantics
worth knowing:

- ``Adam`` with ``adam_w_mode: true`` (the default!) applies decoupled (AdamW) weight decay;
  set ``adam_w_mode: false`` for classic L2 Adam. ``AdamW`` always decouples (an ``adam_w_mode:
  false`` there is ignored and reported, as DeepSpeed ignores it). ``torch_adam``
  asks for torch.optim's implementation instead of the fused one. Neither key is an optimizer
  constructor argument; the engine consumes them.
- Schedules count optimizer steps. WarmupLR ramps ``warmup_min_lr -> warmup_max_lr`` over
  ``warmup_num_steps`` (``log`` or ``linear``) then holds; WarmupDecayLR then decays linearly
  back to ``warmup_min_lr`` at ``total_num_steps``; WarmupCosineLR warms the ratio up from
  ``warmup_min_ratio`` to 1, then follows a cosine down to ``cos_min_ratio`` (ratios of the
  optimizer's lr); OneCycle cycles the lr ``cycle_min_lr -> cycle_max_lr -> cycle_min_lr`` (and
  momentum the opposite way), then decays by ``decay_lr_rate`` every ``decay_step_size`` steps.
- ``OneBitAdam`` / ``OneBitLamb`` (DeepSpeed's 1-bit optimizers, `tachyon.engine.optim.onebit`)
  take DeepSpeed's params with its defaults (``freeze_step: 100000``!). ``cuda_aware`` is accepted
  and has no effect (torch.distributed needs no CUDA-aware MPI); ``comm_backend_name`` must be
  ``nccl`` or ``gloo`` (both mean the data-parallel group's own torch.distributed backend).
  ``eps_inside_sqrt: true``, ``max_grad_norm > 0`` and ``amsgrad: true``, which DeepSpeed accepts
  and silently ignores, are refused (use ``gradient_clipping`` to clip).
- ``ZeroOneAdam`` (DeepSpeed's 0/1 Adam, `tachyon.engine.optim.zero_one_adam`) takes DeepSpeed's
  params with its defaults (``var_freeze_step: 100000``, ``var_update_scaler: 16``,
  ``local_step_scaler: 32678``, ``local_step_clipper: 16``), with the same refusals; ZeRO stage 0
  only (it averages gradients itself; DeepSpeed does not combine it with ZeRO either).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .errors import (
    join_path,
    not_supported,
    render,
    unknown_choice,
    unknown_key,
    validation_problems,
)
from .types import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    UnitFloat,
    WarmupType,
    problem,
)


def _pair(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise PydanticCustomError("pair", "should be a pair [beta1, beta2]")
        return tuple(value)
    return value


Betas = Annotated[
    tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]],
    BeforeValidator(_pair),
]


class AdamParams(Section):
    lr: NonNegativeFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    amsgrad: bool = False  # true is refused: the fused Adam has no AMSGrad
    torch_adam: bool = False
    adam_w_mode: bool = True
    bias_correction: bool = True


class LambParams(Section):
    lr: NonNegativeFloat = 1e-3
    betas: Betas = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    max_coeff: PositiveFloat = 10.0
    min_coeff: NonNegativeFloat = 0.01
    bias_correction: bool = True

    @model_validator(mode="after")
    def _coeff_order(self) -> LambParams:
        if self.min_coeff > self.max_coeff:
            raise problem(
                f"`optimizer.params.min_coeff` ({self.min_coeff}) must not exceed "
                f"`optimizer.params.max_coeff` ({self.max_coeff})"
            )
        return self


ONEBIT_COMM_BACKENDS = ("nccl", "gloo")
"""``comm_backend_name`` values the 1-bit optimizers accept (DeepSpeed's "mpi" / "hccl" are not
available: tachyon's compressed collectives run on torch.distributed)."""


class OneBitAdamParams(Section):
    """DeepSpeed's OnebitAdam arguments and defaults (deepspeed/runtime/fp16/onebit/adam.py)."""

    lr: NonNegativeFloat = 1e-3
    freeze_step: PositiveInt = 100000
    bias_correction: bool = True
    betas: Betas = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: NonNegativeFloat = 0.0
    max_grad_norm: NonNegativeFloat = 0.0
    amsgrad: bool = False  # true is refused (the variance is frozen)
    cuda_aware: bool = False
    comm_backend_name: str = "nccl"

    @model_validator(mode="after")
    def _supported(self) -> OneBitAdamParams:
        if self.comm_backend_name not in ONEBIT_COMM_BACKENDS:
            raise problem(
                f"`optimizer.params.comm_backend_name` {self.comm_backend_name!r} is not available; allowed: "
                f"{', '.join(ONEBIT_COMM_BACKENDS)} (both run torch.distributed collectives on the "
                "data-parallel group's backend)"
            )
        if self.eps_inside_sqrt:
            raise problem(
                "`optimizer.params.eps_inside_sqrt: true` is not supported by the 1-bit optimizers "
                "(DeepSpeed ignores it); remove it or set it to false"
            )
        if self.max_grad_norm > 0:
            raise problem(
                f"`optimizer.params.max_grad_norm: {self.max_grad_norm}` is not supported by the 1-bit "
                "optimizers (DeepSpeed ignores it); set it to 0 and use the top-level `gradient_clipping`"
            )
        return self


class OneBitLambParams(OneBitAdamParams):
    """DeepSpeed's OnebitLamb arguments and defaults (deepspeed/runtime/fp16/onebit/lamb.py)."""

    max_coeff: PositiveFloat = 10.0
    min_coeff: NonNegativeFloat = 0.01
    coeff_beta: Annotated[float, Field(ge=0, lt=1)] = 0.9
    factor_max: PositiveFloat = 4.0
    factor_min: NonNegativeFloat = 0.5
    factor_threshold: NonNegativeFloat = 0.1

    @model_validator(mode="after")
    def _ranges(self) -> OneBitLambParams:
        for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
            if getattr(self, low) > getattr(self, high):
                raise problem(
                    f"`optimizer.params.{low}` ({getattr(self, low)}) must not exceed "
                    f"`optimizer.params.{high}` ({getattr(self, high)})"
                )
        return self


class ZeroOneAdamParams(Section):
    """DeepSpeed's ZeroOneAdam arguments and defaults (deepspeed/runtime/fp16/onebit/zoadam.py)."""

    lr: NonNegativeFloat = 1e-3
    bias_correction: bool = True
    betas: Betas = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: NonNegativeFloat = 0.0
    max_grad_norm: NonNegativeFloat = 0.0
    var_freeze_step: PositiveInt = 100000
    var_update_scaler: PositiveInt = 16
    local_step_scaler: PositiveInt = 32678
    local_step_clipper: PositiveInt = 16
    amsgrad: bool = False  # true is refused (the variance is frozen)
    cuda_aware: bool = False
    comm_backend_name: str = "nccl"

    _supported = OneBitAdamParams._supported


class SGDParams(Section):
    lr: NonNegativeFloat = 1e-3
    momentum: NonNegativeFloat = 0.0
    dampening: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0
    nesterov: bool = False

    @model_validator(mode="after")
    def _nesterov(self) -> SGDParams:
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise problem(
                "`optimizer.params.nesterov: true` needs `optimizer.params.momentum` > 0 and "
                f"`optimizer.params.dampening` == 0; got momentum={self.momentum}, "
                f"dampening={self.dampening}"
            )
        return self


class _SchedulerParams(Section):
    last_batch_iteration: Annotated[int, Field(ge=-1)] = -1


LrValue = NonNegativeFloat | list[NonNegativeFloat]
"""One lr for every param group, or one per group (DeepSpeed's schedules take both)."""


class WarmupLRParams(_SchedulerParams):
    warmup_min_lr: LrValue = 0.0
    warmup_max_lr: LrValue | None = None
    """None: each param group warms up to its own lr (DeepSpeed's WarmupLR)."""
    warmup_num_steps: PositiveInt = 1000
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: PositiveInt
    warmup_max_lr: LrValue = 0.001


class LRRangeTestParams(_SchedulerParams):
    lr_range_test_min_lr: LrValue = 1e-3
    lr_range_test_step_size: PositiveInt = 2000
    lr_range_test_step_rate: NonNegativeFloat = 1.0
    lr_range_test_staircase: bool = False


class WarmupCosineLRParams(_SchedulerParams):
    total_num_steps: PositiveInt
    warmup_min_ratio: UnitFloat = 0.0
    warmup_num_steps: PositiveInt = 1000
    cos_min_ratio: UnitFloat = 0.0001
    warmup_type: WarmupType = "log"


class OneCycleParams(_SchedulerParams):
    cycle_min_lr: NonNegativeFloat
    cycle_max_lr: NonNegativeFloat
    decay_lr_rate: NonNegativeFloat = 0.0
    cycle_first_step_size: PositiveInt = 2000
    cycle_second_step_size: NonNegativeInt | None = None
    cycle_first_stair_count: NonNegativeInt = 0
    cycle_second_stair_count: NonNegativeInt | None = None
    decay_step_size: NonNegativeInt = 0
    cycle_momentum: bool = True
    cycle_min_mom: UnitFloat = 0.8
    cycle_max_mom: UnitFloat = 0.9
    decay_mom_rate: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _ranges(self) -> OneCycleParams:
        if self.cycle_min_lr > self.cycle_max_lr:
            raise problem(
                f"`scheduler.params.cycle_min_lr` ({self.cycle_min_lr}) must not exceed "
                f"`scheduler.params.cycle_max_lr` ({self.cycle_max_lr})"
            )
        if self.cycle_momentum and self.cycle_min_mom > self.cycle_max_mom:
            raise problem(
                f"`scheduler.params.cycle_min_mom` ({self.cycle_min_mom}) must not exceed "
                f"`scheduler.params.cycle_max_mom` ({self.cycle_max_mom})"
            )
        return self


OPTIMIZER_PARAMS: dict[str, type[Section]] = {
    "Adam": AdamParams,
    "AdamW": AdamParams,
    "Lamb": LambParams,
    "SGD": SGDParams,
    "OneBitAdam": OneBitAdamParams,
    "OneBitLamb": OneBitLambParams,
    "ZeroOneAdam": ZeroOneAdamParams,
}
"""Canonical optimizer name -> model of its ``params``."""

SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
"""Canonical scheduler name -> model of its ``params``."""

UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "Adagrad": "Adagrad",
    "Lion": "Lion",
    "MuAdam": "muP Adam",
    "MuAdamW": "muP AdamW",
    "MuSGD": "muP SGD",
    "Muon": "Muon",
}
"""DeepSpeed optimizer types tachyon refuses for now -> what they are."""

UNSUPPORTED_SCHEDULERS: dict[str, str] = {}
"""DeepSpeed scheduler types tachyon refuses for now -> what they are."""


def _check_type(
    path: str, value: Any, supported: dict[str, Any], unsupported: dict[str, str]
) -> tuple[str | None, list[str]]:
    """Canonical name for ``value`` or the problem with it."""
    if value is None:
        return None, [f"`{path}` is required (one of {', '.join(supported)})"]
    if isinstance(value, str):
        lowered = value.lower()
        for name in supported:
            if name.lower() == lowered:
                return name, []
        for name, what in unsupported.items():
            if name.lower() == lowered:
                fix = f"use one of {', '.join(supported)}"
                return None, [not_supported(path, what, value, fix=fix)]
    return None, [unknown_choice(path, value, list(supported))]


def check_typed_section(section: str, raw: dict[str, Any]) -> tuple[dict | None, list[str]]:
    """Check ``raw`` (the ``optimizer`` or ``scheduler`` dict, keys already checked) and return
    ``{"type": canonical, "params": {every param, defaults filled}}`` or the problems found."""
    if section == "optimizer":
        supported, unsupported = OPTIMIZER_PARAMS, UNSUPPORTED_OPTIMIZERS
    else:
        supported, unsupported = SCHEDULER_PARAMS, UNSUPPORTED_SCHEDULERS
    type_path = join_path(section, "type")
    name, problems = _check_type(type_path, raw.get("type"), supported, unsupported)
    params_path = join_path(section, "params")
    params = raw.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        problems.append(f"`{params_path}` should be a JSON object; got {render(params)}")
    if name is None or problems:
        return None, problems

    model = supported[name]
    allowed = list(model.model_fields)
    for key in params:
        if key not in allowed:
            problems.append(unknown_key(join_path(params_path, key), params_path, allowed))
    if section == "optimizer":
        if params.get("amsgrad") is True:
            problems.append(
                not_supported(join_path(params_path, "amsgrad"), "AMSGrad", True, "false")
            )
    if problems:
        return None, problems
    try:
        validated = model.model_validate(params)
    except ValidationError as error:
        return None, validation_problems(error, params_path)
    filled = validated.model_dump()
    if name == "AdamW":
        filled["adam_w_mode"] = True
    return {"type": name, "params": filled}, []
