"""``deepspeed.runtime.precision_config``: ``DeepSpeedBF16Config``, ``DeepSpeedFP16Config``,
``get_bfloat16_config``, ``get_float16_config``, over `tachyon.config.BF16Config` /
`tachyon.config.FP16Config`.

The section's keys are validated as tachyon's ``"bf16"`` / ``"fp16"`` section (``auto_cast: true``,
``fp16_master_weights_and_grads: true``, ``bf16_master_weights_and_grads: true`` and
``bf16_optimizer_states: true`` are refused by name) and every field of DeepSpeed 0.19.6's class is
an attribute with DeepSpeed's value (``immediate_grad_update``, which tachyon accepts and ignores,
as given). ``get_bfloat16_config`` reads ``"bf16"``, else DeepSpeed's older ``"bfloat16"``.
"""

from __future__ import annotations

from typing import Any

from tachyon.compat.deepspeed.runtime._section_view import DSField, SectionView, section_dict

BFLOAT16, BFLOAT16_OLD, FP16 = "bf16", "bfloat16", "fp16"

# the keys of DeepSpeed's dynamic_loss_scale_args() (deepspeed.runtime.fp16.loss_scaler)
INITIAL_LOSS_SCALE, SCALE_WINDOW, DELAYED_SHIFT = "init_scale", "scale_window", "delayed_shift"
CONSECUTIVE_HYSTERESIS, MIN_LOSS_SCALE = "consecutive_hysteresis", "min_scale"


class DeepSpeedBF16Config(SectionView):
    """DeepSpeed's ``"bf16"`` section; ``tachyon_config`` is tachyon's `BF16Config`."""

    SECTION = BFLOAT16
    FIELDS = {
        "enabled": DSField(False, tachyon="enabled"),
        "immediate_grad_update": DSField(False),
        "check_grad_overflow": DSField(True, tachyon="check_grad_overflow"),
        "bf16_master_weights_and_grads": DSField(False),
        "bf16_optimizer_states": DSField(False),
    }


class DeepSpeedFP16Config(SectionView):
    """DeepSpeed's ``"fp16"`` section; ``tachyon_config`` is tachyon's `FP16Config`."""

    SECTION = FP16
    FIELDS = {
        "enabled": DSField(False, tachyon="enabled"),
        "auto_cast": DSField(False, tachyon="auto_cast"),
        "loss_scale": DSField(0.0, tachyon="loss_scale"),
        "initial_scale_power": DSField(16, tachyon="initial_scale_power"),
        "loss_scale_window": DSField(1000, tachyon="loss_scale_window"),
        "hysteresis": DSField(2, tachyon="hysteresis"),
        "consecutive_hysteresis": DSField(False, tachyon="consecutive_hysteresis"),
        "min_loss_scale": DSField(1, tachyon="min_loss_scale"),
        "fp16_master_weights_and_grads": DSField(False),
    }

    def initial_dynamic_scale(self) -> int:
        return 2 ** self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's arguments under DeepSpeed's key names."""
        return {
            INITIAL_LOSS_SCALE: 2 ** self.initial_scale_power,
            SCALE_WINDOW: self.loss_scale_window,
            DELAYED_SHIFT: self.hysteresis,
            CONSECUTIVE_HYSTERESIS: self.consecutive_hysteresis,
            MIN_LOSS_SCALE: self.min_loss_scale,
        }


def get_bfloat16_config(param_dict: dict[str, Any]) -> DeepSpeedBF16Config:
    """The ``"bf16"`` section of a DeepSpeed config dict, else its older name ``"bfloat16"``, else
    the defaults."""
    return DeepSpeedBF16Config(**section_dict(param_dict, BFLOAT16, BFLOAT16_OLD))


def get_float16_config(param_dict: dict[str, Any]) -> DeepSpeedFP16Config:
    """The ``"fp16"`` section of a DeepSpeed config dict, else the defaults."""
    return DeepSpeedFP16Config(**section_dict(param_dict, FP16))


__all__ = ["BFLOAT16", "BFLOAT16_OLD", "FP16", "DeepSpeedBF16Config", "DeepSpeedFP16Config",
           "get_bfloat16_config", "get_float16_config"]
