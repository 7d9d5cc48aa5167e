"""``deepspeed.runtime.config``: ``DeepSpeedConfig``, DeepSpeed's parsed-config object, on
`tachyon.config.load_config`.

``DeepSpeedConfig(config, mpu=None)`` validates ``config`` (a dict or a JSON / Hjson path) the way
``tachyon.initialize`` does, with the batch sizes resolved for the data-parallel size (``mpu``'s,
else the world size of the running process group, else 1), and exposes DeepSpeed's attribute
names over it (``train_batch_size``, ``zero_optimization_stage``, ``fp16_enabled``,
``optimizer_name``, ``gradient_allreduce_op``, ...) and section objects (``zero_config``,
``float16_config``, ``bfloat16_config``: `runtime.zero.config` / `runtime.precision_config`'s
classes). The raw dict is ``_param_dict``; the validated `TachyonConfig` is ``tachyon_config``.
Problems raise ``DeepSpeedConfigError`` (tachyon's ``ConfigError``, which lists every problem;
DeepSpeed raises on the first, sometimes as an AssertionError).

``_configure_train_batch_size()`` re-derives the three batch sizes from the ones set on the object
(None = not given) for ``world_size`` ranks, as DeepSpeed's does; inconsistent sizes raise
`BatchSizeError`, a ConfigError that is also the AssertionError DeepSpeed raises.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist

from tachyon.compat.deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
from tachyon.compat.deepspeed.runtime.zero.config import get_zero_config
from tachyon.config import ConfigError, load_config, resolve_batch_sizes
from tachyon.config.config import _as_dict

DeepSpeedConfigError = ConfigError


class BatchSizeError(ConfigError, AssertionError):
    """Batch sizes that do not fit together (DeepSpeed asserts)."""


# DeepSpeed's eigenvalue defaults (runtime/constants.py). DeepSpeed reads the eigenvalue settings
# only when compression_training's weight quantization is on, which tachyon refuses, so a config
# tachyon accepts always has these.
_EIGENVALUE_DEFAULTS = {"enabled": False, "verbose": False, "max_iter": 100, "tol": 1e-2, "stability": 1e-6,
                        "gas_boundary_resolution": 1, "layer_name": "bert.encoder.layer", "layer_num": 0}

ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER = "adam", "adamw", "lamb"
ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, SGD_OPTIMIZER = "onebitadam", "onebitlamb", "sgd"
DEEPSPEED_OPTIMIZERS = [ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER,
                        ONEBIT_LAMB_OPTIMIZER, SGD_OPTIMIZER]


class DeepSpeedConfig:
    """DeepSpeed's config object over a validated `tachyon.config.TachyonConfig`."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None):
        del mesh_device
        self._param_dict = copy.deepcopy(_as_dict(config))
        if mpu is not None:
            data_parallel = mpu.get_data_parallel_world_size()
        elif dist.is_available() and dist.is_initialized():
            data_parallel = dist.get_world_size()
        else:
            data_parallel = 1
        self.world_size = data_parallel
        cfg = self.tachyon_config = load_config(self._param_dict, data_parallel, data_parallel_size=data_parallel)
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.steps_per_print = cfg.steps_per_print
        self.gradient_clipping = cfg.gradient_clipping
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.communication_data_type = cfg.communication_data_type
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.memory_breakdown = bool(self._param_dict.get("memory_breakdown", False))
        self.dump_state = bool(self._param_dict.get("dump_state", False))
        self.dataloader_drop_last = cfg.dataloader_drop_last
        self.gradient_allreduce_op = str(self._param_dict.get("gradient_allreduce_op") or "mean").lower()
        self.zero_config = get_zero_config(self._param_dict)
        self.float16_config = get_float16_config(self._param_dict)
        self.bfloat16_config = get_bfloat16_config(self._param_dict)
        self.zero_optimization_stage = cfg.zero_stage
        self.zero_enabled = cfg.zero_stage > 0
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        self.fp16_enabled = cfg.fp16.enabled
        self.fp16_auto_cast = cfg.fp16.auto_cast
        self.bfloat16_enabled = cfg.bf16.enabled
        self.amp_enabled = False
        self.loss_scale = cfg.fp16.loss_scale
        self.initial_dynamic_scale = 2 ** cfg.fp16.initial_scale_power
        self.grad_accum_dtype = cfg.data_types.grad_accum_dtype
        self.optimizer_name = self._optimizer_name()
        self.optimizer_params = dict(cfg.optimizer.params) if cfg.optimizer is not None else None
        self.scheduler_name = cfg.scheduler.type if cfg.scheduler is not None else None
        self.scheduler_params = dict(cfg.scheduler.params) if cfg.scheduler is not None else None
        self.activation_checkpointing_config = cfg.activation_checkpointing
        self.flops_profiler_config = cfg.flops_profiler
        self.pld_enabled = cfg.progressive_layer_drop.enabled
        self.pld_params = ({"theta": cfg.progressive_layer_drop.theta, "gamma": cfg.progressive_layer_drop.gamma}
                           if self.pld_enabled else False)
        self.checkpoint_tag_validation_enabled = str(cfg.checkpoint.tag_validation).lower() != "ignore"
        self.checkpoint_tag_validation_fail = str(cfg.checkpoint.tag_validation).lower() == "fail"
        for key, value in _EIGENVALUE_DEFAULTS.items():
            setattr(self, f"eigenvalue_{key}", value)

    def _configure_train_batch_size(self) -> None:
        """Derive the missing batch sizes from those set (DeepSpeed's method, on
        `tachyon.config.resolve_batch_sizes`); raises `BatchSizeError` when they do not fit."""
        sizes = {"train_batch_size": self.train_batch_size,
                 "train_micro_batch_size_per_gpu": self.train_micro_batch_size_per_gpu,
                 "gradient_accumulation_steps": self.gradient_accumulation_steps}
        for key, value in sizes.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BatchSizeError(f"`{key}` should be an integer >= 1; got {value!r}")
        try:
            resolved = resolve_batch_sizes(*sizes.values(), self.world_size)
        except ConfigError as error:
            raise BatchSizeError(error.problems) from None
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = resolved

    def _optimizer_name(self) -> str | None:
        optimizer = self.tachyon_config.optimizer
        if optimizer is None:
            return None
        return optimizer.type.lower() if optimizer.type.lower() in DEEPSPEED_OPTIMIZERS else optimizer.type

    def print(self, name: str) -> None:
        """Print the config under a heading (DeepSpeed's ``print``)."""
        print(f"{name}:")
        for key, value in sorted(self.tachyon_config.to_dict().items()):
            print(f"  {key} {'.' * max(1, 28 - len(key))} {value}")


__all__ = ["BatchSizeError", "DeepSpeedConfig", "DeepSpeedConfigError"]
