"""DeepSpeed's config section classes on tachyon's config (``runtime.zero.config``,
``runtime.precision_config``), the DeepSpeedConfig attributes DeepSpeed's config tests read, and
the ``hjson`` stand-in the vendored tests import."""

from __future__ import annotations

import logging
import sys

import pytest

import tachyon.compat.deepspeed as deepspeed
from tachyon.compat.deepspeed.runtime.config import BatchSizeError, DeepSpeedConfig
from tachyon.compat.deepspeed.runtime.config_utils import DeprecatedFieldConflict
from tachyon.compat.deepspeed.runtime.precision_config import (
    DeepSpeedBF16Config,
    get_bfloat16_config,
    get_float16_config,
)
from tachyon.compat.deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum, get_zero_config
from tachyon.config import BF16Config, ConfigError, ZeroConfig
from tachyon.config.hjson import loads as read_hjson


def test_zero_config_has_deepspeeds_fields_aliases_and_defaults():
    zero = DeepSpeedZeroConfig(stage=2, reduce_bucket_size=2e8, stage3_max_live_parameters=7)
    assert isinstance(zero.tachyon_config, ZeroConfig) and zero.tachyon_config.stage == 2
    assert zero.stage == ZeroStageEnum.gradients and zero.reduce_bucket_size == 200_000_000
    assert zero.max_live_parameters == zero.stage3_max_live_parameters == 7
    assert zero.max_reuse_distance == 1_000_000_000 and zero.param_persistence_threshold == 100_000
    assert zero.prefetch_bucket_size == 50_000_000 and zero.allgather_partitions is True
    assert zero.overlap_comm is False and DeepSpeedZeroConfig(stage=3).overlap_comm is True  # None: stage 3 only
    assert DeepSpeedZeroConfig(stage=3, overlap_comm=False).overlap_comm is False
    assert get_zero_config({"zero_optimization": {"stage": 1}}).stage == 1 and get_zero_config({}).stage == 0


@pytest.mark.parametrize("key", ["gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save"])
def test_zero_config_gather_weights_under_each_name(key, caplog):
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        assert DeepSpeedZeroConfig(**{key: True}).gather_16bit_weights_on_model_save is True
    assert ("is deprecated" in caplog.text) == (key == "stage3_gather_fp16_weights_on_model_save")
    assert DeepSpeedZeroConfig().gather_16bit_weights_on_model_save is False


def test_zero_config_deprecated_offload_and_conflicts():
    zero = DeepSpeedZeroConfig(stage=2, cpu_offload=True)
    assert zero.cpu_offload is True and zero.offload_optimizer.device == "cpu"
    with pytest.raises(DeprecatedFieldConflict) as error:
        DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True, gather_16bit_weights_on_model_save=True)
    assert isinstance(error.value, AssertionError)  # what DeepSpeed's assert raises
    with pytest.raises(ConfigError, match="name the same setting"):
        DeepSpeedZeroConfig(max_live_parameters=1, stage3_max_live_parameters=2)


def test_zero_config_refuses_what_tachyon_refuses_and_checks_ignored_keys():
    with pytest.raises(ConfigError, match=r"zero_quantized_weights: true.*\(ZeRO\+\+ quantized weights\)"):
        DeepSpeedZeroConfig(zero_quantized_weights=True)
    assert DeepSpeedZeroConfig(zero_quantized_weights=False).zero_quantized_weights is False
    with pytest.raises(ConfigError, match="did you mean 'zero_optimization.reduce_bucket_size'"):
        DeepSpeedZeroConfig(reduce_bucket_sise=1)
    with pytest.raises(ConfigError, match="max_live_parameters` should be an integer"):
        DeepSpeedZeroConfig(stage3_max_live_parameters="many")
    with pytest.raises(ConfigError, match="`zero_optimization: true` is DeepSpeed's legacy form"):
        get_zero_config({"zero_optimization": True})


def test_zero_config_assignment_revalidates_and_a_refused_value_changes_nothing():
    zero = DeepSpeedZeroConfig(stage=1, stage3_max_live_parameters=5)
    zero.stage = 2
    assert zero.stage == 2 and zero.tachyon_config.stage == 2 and zero.max_live_parameters == 5
    zero.stage3_max_live_parameters = 9
    assert zero.max_live_parameters == 9
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        zero.stage = 7
    assert zero.stage == 2 and zero.tachyon_config.stage == 2
    with pytest.raises(AttributeError, match="no field 'stagee'"):
        zero.stagee = 1


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_bfloat16_config_reads_both_names(key):
    bf16 = get_bfloat16_config({key: {"enabled": True, "immediate_grad_update": True}})
    assert isinstance(bf16, DeepSpeedBF16Config) and isinstance(bf16.tachyon_config, BF16Config)
    assert bf16.enabled is True and bf16.immediate_grad_update is True and bf16.check_grad_overflow is True
    assert get_bfloat16_config({}).enabled is False
    with pytest.raises(ConfigError, match="bf16_optimizer_states: true"):
        get_bfloat16_config({key: {"bf16_optimizer_states": True}})


def test_float16_config_and_its_loss_scale_args():
    fp16 = get_float16_config({"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3}})
    assert fp16.enabled and fp16.initial_dynamic_scale() == 256
    assert fp16.dynamic_loss_scale_args() == {"init_scale": 256, "scale_window": 1000, "delayed_shift": 3,
                                              "consecutive_hysteresis": False, "min_scale": 1}
    assert fp16.tachyon_config.hysteresis == 1  # tachyon without ZeRO halves at every overflow, as DeepSpeed does
    with pytest.raises(ConfigError, match="fp16.auto_cast: true"):
        get_float16_config({"fp16": {"enabled": True, "auto_cast": True}})


def test_deepspeed_config_sections_and_gradient_allreduce_op():
    config = DeepSpeedConfig({"train_batch_size": 4, "gradient_allreduce_op": "MEAN", "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2}})
    assert config.gradient_allreduce_op == "mean"
    assert DeepSpeedConfig({"train_batch_size": 4}).gradient_allreduce_op == "mean"
    assert isinstance(config.zero_config, DeepSpeedZeroConfig) and config.zero_config.stage == 2
    assert config.bfloat16_config.enabled and not config.float16_config.enabled
    assert config.eigenvalue_enabled is False and config.eigenvalue_max_iter == 100
    with pytest.raises(ValueError, match="Invalid gradient_allreduce_op"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "max"})
    with pytest.raises(ConfigError, match=r"\(summing gradients") as error:
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum"})
    assert "DeepSpeed refuses it too" not in str(error.value)
    with pytest.raises(ConfigError, match="DeepSpeed refuses it too: 'sum' is not supported with ZeRO stage 3"):
        DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})


def test_deepspeed_config_configure_train_batch_size():
    config = DeepSpeedConfig({"train_batch_size": 8})
    config.world_size = 2
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = 32, 8, None
    config._configure_train_batch_size()
    assert config.gradient_accumulation_steps == 2
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = 33, 17, 2
    with pytest.raises(BatchSizeError) as error:
        config._configure_train_batch_size()
    assert isinstance(error.value, AssertionError) and isinstance(error.value, ConfigError)
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = 0, None, None
    with pytest.raises(BatchSizeError, match="train_batch_size` should be an integer >= 1"):
        config._configure_train_batch_size()


def test_version_attributes():
    assert deepspeed.__git_hash__ == deepspeed.__git_branch__ == "[none]"  # DeepSpeed's value outside a git build


def test_hjson_stand_in_writes_hjson_that_reads_back():
    from tests.compat.deepspeed_upstream import _hjson

    data = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.99]}},
            "name": "a b", "number_text": "1.5", "empty": "", "flag": True, "none": None}
    text = _hjson.dumps(data)
    assert '"train_batch_size"' not in text and "type: Adam" in text  # Hjson, not JSON
    assert read_hjson(text) == data
    with pytest.raises(NotImplementedError, match="formatting options"):
        _hjson.dumps(data, indent=4)
    # loads, which tachyon's config loader calls once the stand-in is `hjson`: the hook sees every object's pairs
    seen = []
    assert _hjson.loads(text, object_pairs_hook=lambda pairs: seen.append(pairs) or dict(pairs)) == data
    assert [key for key, _ in seen[-1]] == list(data) and len(seen) == 3
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        _hjson.loads("{a: 1\na: 2}", object_pairs_hook=dict)
    assert "hjson" not in sys.modules or sys.modules["hjson"] is not _hjson  # only the vendored tests alias it
