"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, ``get_zero_config``,
``ZeroStageEnum``, over `tachyon.config.ZeroConfig`.

``DeepSpeedZeroConfig(**zero_optimization)`` validates the keys as tachyon's
``"zero_optimization"`` section (a feature tachyon does not have, such as ZeRO++ quantized weights
or MiCS, is refused by name) and has every field of DeepSpeed 0.19.6's class with DeepSpeed's
value: ``stage``, the bucket sizes, ``overlap_comm`` (None means true at stage 3 only), the offload
sections (tachyon's models: ``device``, ``pin_memory``, ``ratio``), and the ZeRO-3 / ZeRO++ knobs
tachyon accepts and ignores (``max_live_parameters``, ``gather_16bit_weights_on_model_save``, ...)
as given or at DeepSpeed's default. The ``stage3_`` aliases and the deprecated ``cpu_offload``,
``cpu_offload_param`` and ``stage3_gather_fp16_weights_on_model_save`` work as in DeepSpeed.
"""

from __future__ import annotations

import sys
import types
from enum import Enum
from typing import Any

from tachyon.compat.deepspeed.runtime._section_view import DSField, SectionView
from tachyon.config import ConfigError
from tachyon.config.keys import _not_a_section

ZERO_OPTIMIZATION = "zero_optimization"

_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class ZeroStageEnum(int, Enum):
    """DeepSpeed's ZeRO stages."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _leaf_module_default() -> types.SimpleNamespace:
    return types.SimpleNamespace(classes=list(_LEAF_MODULE_CLASSES), names=[], name_suffixes=[])


class DeepSpeedZeroConfig(SectionView):
    """DeepSpeed's ZeRO section (module docstring); ``tachyon_config`` is tachyon's `ZeroConfig`."""

    SECTION = ZERO_OPTIMIZATION
    FIELDS = {
        "stage": DSField(0, tachyon="stage"),
        "contiguous_gradients": DSField(True, tachyon="contiguous_gradients"),
        "reduce_scatter": DSField(True, tachyon="reduce_scatter"),
        "reduce_bucket_size": DSField(500_000_000, tachyon="reduce_bucket_size"),
        "use_multi_rank_bucket_allreduce": DSField(True),
        "allgather_partitions": DSField(True),
        "allgather_bucket_size": DSField(500_000_000, tachyon="allgather_bucket_size"),
        "overlap_comm": DSField(None),  # resolved in _resolve: None means stage == 3
        "load_from_fp32_weights": DSField(True),
        "elastic_checkpoint": DSField(False),
        "offload_param": DSField(None, tachyon="offload_param"),
        "offload_optimizer": DSField(None, tachyon="offload_optimizer"),
        "zenflow": DSField(None),
        "sub_group_size": DSField(1_000_000_000),
        "cpu_offload_param": DSField(None, replaces="offload_param"),
        "cpu_offload_use_pin_memory": DSField(None, deprecated="offload_param or offload_optimizer"),
        "cpu_offload": DSField(None, replaces="offload_optimizer"),
        "prefetch_bucket_size": DSField(50_000_000, alias="stage3_prefetch_bucket_size",
                                        tachyon="stage3_prefetch_bucket_size"),
        "param_persistence_threshold": DSField(100_000, alias="stage3_param_persistence_threshold"),
        "model_persistence_threshold": DSField(sys.maxsize, alias="stage3_model_persistence_threshold"),
        "max_live_parameters": DSField(1_000_000_000, alias="stage3_max_live_parameters"),
        "max_reuse_distance": DSField(1_000_000_000, alias="stage3_max_reuse_distance"),
        "gather_16bit_weights_on_model_save": DSField(False, alias="stage3_gather_16bit_weights_on_model_save"),
        "module_granularity_threshold": DSField(0, alias="stage3_module_granularity_threshold"),
        "use_all_reduce_for_fetch_params": DSField(False, alias="stage3_use_all_reduce_for_fetch_params"),
        "allgather_sequential": DSField(False, alias="stage3_allgather_sequential"),
        "stage3_gather_fp16_weights_on_model_save": DSField(False, replaces="gather_16bit_weights_on_model_save"),
        "ignore_unused_parameters": DSField(True),
        "legacy_stage1": DSField(False),
        "round_robin_gradients": DSField(False, tachyon="round_robin_gradients"),
        "zero_hpz_partition_size": DSField(1),
        "zero_quantized_weights": DSField(False),
        "zero_quantized_nontrainable_weights": DSField(False),
        "zero_quantized_gradients": DSField(False),
        "zeropp_loco_param": DSField(None),
        "mics_shard_size": DSField(-1),
        "mics_hierarchical_params_gather": DSField(False),
        "memory_efficient_linear": DSField(True),
        "pipeline_loading_checkpoint": DSField(False),
        "override_module_apply": DSField(True),
        "log_trace_cache_warnings": DSField(False),
        "enable_sanity_checks": DSField(False),
        "save_muon_momentum_buffer_in_memory": DSField(False),
        "leaf_module": DSField(_leaf_module_default),
    }

    def _resolve(self, values: dict[str, Any], given: dict[str, Any]) -> None:
        overlap = given.get("overlap_comm")  # tachyon checked it is a bool or null
        values["overlap_comm"] = values["stage"] == ZeroStageEnum.weights if overlap is None else overlap
        if isinstance(values["leaf_module"], dict):
            values["leaf_module"] = types.SimpleNamespace(**{**vars(_leaf_module_default()), **values["leaf_module"]})


def get_zero_config(param_dict: dict[str, Any]) -> DeepSpeedZeroConfig:
    """The ``"zero_optimization"`` section of a DeepSpeed config dict (``{}`` when absent). The
    legacy ``"zero_optimization": true`` form is refused, as by ``tachyon.initialize``."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        raise ConfigError(_not_a_section(ZERO_OPTIMIZATION, section))
    return DeepSpeedZeroConfig(**(section or {}))


__all__ = ["DeepSpeedZeroConfig", "ZERO_OPTIMIZATION", "ZeroStageEnum", "get_zero_config"]
