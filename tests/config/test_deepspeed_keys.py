"""Every key DeepSpeed reads, in the sections tachyon implements, is handled: a field tachyon
uses, a feature refused by name (with the value that turns it off), or a key accepted and ignored
with a reason. Never "unknown key". And real DeepSpeed configs start."""

from __future__ import annotations

import json

import pytest

from tachyon.config import ACCEPTED_IGNORED_KEYS, UNSUPPORTED_KEYS, ConfigError, TachyonConfig, load_config
from tachyon.config.keys import _lookup_unsupported, ignored_reason, walk
from tachyon.config.config import _deprecated_offload_keys

DEEPSPEED_KEYS = """
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping steps_per_print
wall_clock_breakdown memory_breakdown dump_state prescale_gradients gradient_predivide_factor communication_data_type
seq_parallel_communication_data_type zero_allow_untested_optimizer zero_force_ds_cpu_optimizer sparse_gradients
disable_allgather dataloader_drop_last use_data_before_expert_parallelism gradient_allreduce_op
managed_gradient_accumulation log_level vocabulary_size timers graph_harvesting
fp16.enabled fp16.auto_cast fp16.loss_scale fp16.initial_scale_power fp16.loss_scale_window fp16.hysteresis
fp16.consecutive_hysteresis fp16.min_loss_scale fp16.fp16_master_weights_and_grads
bf16.enabled bf16.immediate_grad_update bf16.check_overflow bf16.bf16_master_weights_and_grads
bf16.bf16_optimizer_states data_types.grad_accum_dtype
checkpoint.tag_validation checkpoint.load_universal checkpoint.use_node_local_storage checkpoint.parallel_write
checkpoint.writer progressive_layer_drop.enabled progressive_layer_drop.theta progressive_layer_drop.gamma
zero_optimization.stage zero_optimization.contiguous_gradients zero_optimization.reduce_scatter
zero_optimization.reduce_bucket_size zero_optimization.use_multi_rank_bucket_allreduce
zero_optimization.allgather_partitions zero_optimization.allgather_bucket_size zero_optimization.overlap_comm
zero_optimization.load_from_fp32_weights zero_optimization.elastic_checkpoint zero_optimization.offload_param
zero_optimization.offload_optimizer zero_optimization.zenflow zero_optimization.sub_group_size
zero_optimization.cpu_offload_param zero_optimization.cpu_offload_use_pin_memory zero_optimization.cpu_offload
zero_optimization.prefetch_bucket_size zero_optimization.stage3_prefetch_bucket_size
zero_optimization.param_persistence_threshold zero_optimization.stage3_param_persistence_threshold
zero_optimization.model_persistence_threshold zero_optimization.stage3_model_persistence_threshold
zero_optimization.max_live_parameters zero_optimization.stage3_max_live_parameters
zero_optimization.max_reuse_distance zero_optimization.stage3_max_reuse_distance
zero_optimization.gather_16bit_weights_on_model_save zero_optimization.stage3_gather_16bit_weights_on_model_save
zero_optimization.module_granularity_threshold zero_optimization.stage3_module_granularity_threshold
zero_optimization.use_all_reduce_for_fetch_params zero_optimization.stage3_use_all_reduce_for_fetch_params
zero_optimization.allgather_sequential zero_optimization.stage3_allgather_sequential
zero_optimization.stage3_gather_fp16_weights_on_model_save zero_optimization.ignore_unused_parameters
zero_optimization.legacy_stage1 zero_optimization.round_robin_gradients zero_optimization.zero_hpz_partition_size
zero_optimization.zero_quantized_weights zero_optimization.zero_quantized_nontrainable_weights
zero_optimization.zero_quantized_gradients zero_optimization.zeropp_loco_param zero_optimization.mics_shard_size
zero_optimization.mics_hierarchical_params_gather zero_optimization.memory_efficient_linear
zero_optimization.pipeline_loading_checkpoint zero_optimization.override_module_apply
zero_optimization.log_trace_cache_warnings zero_optimization.enable_sanity_checks
zero_optimization.save_muon_momentum_buffer_in_memory zero_optimization.leaf_module
activation_checkpointing.partition_activations activation_checkpointing.contiguous_memory_optimization
activation_checkpointing.cpu_checkpointing activation_checkpointing.number_checkpoints
activation_checkpointing.synchronize_checkpoint_boundary activation_checkpointing.profile
flops_profiler.enabled flops_profiler.recompute_fwd_factor flops_profiler.profile_step flops_profiler.module_depth
flops_profiler.top_modules flops_profiler.detailed flops_profiler.output_file
tensorboard.enabled tensorboard.output_path tensorboard.job_name csv_monitor.enabled csv_monitor.output_path
csv_monitor.job_name pipeline.stages pipeline.partition pipeline.seed_layers pipeline.activation_checkpoint_interval
pipeline.pipe_partitioned pipeline.grad_partitioned
tensor_parallel.tp_size tensor_parallel.autotp_size tensor_parallel.tp tensor_parallel.tp_grain_size
tensor_parallel.tp_overlap_comm tensor_parallel.partition_config tensor_parallel.preset_model
tensor_parallel.keep_module_on_host
""".split()
"""The keys DeepSpeed 0.19.6 (commit edaa722) reads at the top level and in the sections tachyon
implements: runtime/constants.py, runtime/zero/config.py (fields and their aliases),
runtime/activation_checkpointing/config.py, profiling/config.py, monitor/config.py,
runtime/config.py's get_pipeline_config, runtime/tensor_parallel/config.py."""


def _nested(path: str, value):
    *parents, leaf = path.split(".")
    raw = {leaf: value}
    for part in reversed(parents):
        raw = {part: raw}
    return raw


@pytest.mark.parametrize("path", DEEPSPEED_KEYS)
def test_every_deepspeed_key_is_handled(path):
    problems, ignored = [], {}
    raw = _deprecated_offload_keys(_nested(path, None), problems)  # parse_config reads these first
    walk(raw, TachyonConfig, "", ignored, problems)
    assert not any("unknown key" in p for p in problems), problems
    for problem in problems:  # a refusal names the DeepSpeed feature
        assert "does not support yet" in problem or "ZeRO stage 3" in problem, problem
    if path in ignored:  # accepted with no effect: a reason, or a refused feature's off value
        assert ignored_reason(path) or _lookup_unsupported(path), path


@pytest.mark.parametrize("pin", [False, True])
def test_deprecated_offload_spellings_mean_what_deepspeed_reads(pin):
    config = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": pin}})
    zero = config.zero_optimization
    assert zero.offload_optimizer.device == zero.offload_param.device == "cpu"
    assert zero.offload_optimizer.pin_memory is zero.offload_param.pin_memory is pin
    off = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert not off.zero_optimization.offloads_optimizer
    with pytest.raises(ConfigError, match="older spelling of `offload_optimizer`"):
        load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="cpu_offload` must be true or false"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": "yes"}})


def test_every_ignored_key_says_why_and_no_key_is_both_refused_and_ignored():
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in ACCEPTED_IGNORED_KEYS.values())
    assert not set(ACCEPTED_IGNORED_KEYS) & set(UNSUPPORTED_KEYS)


def test_keys_deepspeed_itself_ignores_are_accepted_and_reported():
    config = load_config({"train_batch_size": 8, "cuda_visible_devices": 0,
                          "flops_profiler": {"enabled": False, "step": 1, "profile_step": 1}})
    assert set(config.ignored_keys) == {"cuda_visible_devices", "flops_profiler.step"}
    with pytest.raises(ConfigError, match="did you mean 'flops_profiler.profile_step'"):
        load_config({"train_batch_size": 8, "flops_profiler": {"profile_stpe": 1}})  # a typo stays an error


@pytest.mark.parametrize("key, value, feature", [
    ("gradient_allreduce_op", "sum", "summing gradients"),
    ("managed_gradient_accumulation", False, "unmanaged gradient accumulation"),
])
def test_deepspeed_switches_tachyon_lacks_are_refused_by_feature_and_accepted_when_off(key, value, feature):
    with pytest.raises(ConfigError, match=feature):
        load_config({"train_batch_size": 8, key: value})
    off = {"gradient_allreduce_op": "mean", "managed_gradient_accumulation": True}[key]
    assert load_config({"train_batch_size": 8, key: off}).ignored_keys == (key,)


def test_gradient_allreduce_op_is_read_as_deepspeed_reads_it():
    """Any case of "mean" is accepted (DeepSpeed lowercases it); anything but mean / sum is invalid,
    not the summing feature; "sum" with ZeRO stage 3 also names DeepSpeed's own refusal."""
    assert load_config({"train_batch_size": 8, "gradient_allreduce_op": "Mean"}).ignored_keys == (
        "gradient_allreduce_op",)
    for value in ("max", None, 1):
        with pytest.raises(ConfigError, match="Invalid gradient_allreduce_op") as error:
            load_config({"train_batch_size": 8, "gradient_allreduce_op": value})
        assert "summing gradients" not in str(error.value)
    with pytest.raises(ConfigError, match=r"\(summing gradients.*; DeepSpeed refuses it too: 'sum' is not supported "
                                          r"with ZeRO stage 3"):
        load_config({"train_batch_size": 8, "gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 3}})


REAL_CONFIGS = {
    # DeepSpeedExamples training/imagenet/config/ds_config.json (abridged to the keys)
    "imagenet": {"train_batch_size": 256, "gradient_accumulation_steps": 1, "steps_per_print": 50,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                          "weight_decay": 3e-7}},
                 "gradient_clipping": 0, "prescale_gradients": False, "cuda_visible_devices": 0,
                 "wall_clock_breakdown": False},
    # DeepSpeed tests/unit/profiling/flops_profiler/test_flops_profiler.py
    "flops_profiler": {"train_batch_size": 1, "steps_per_print": 1,
                       "optimizer": {"type": "Adam", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 0},
                       "fp16": {"enabled": True},
                       "flops_profiler": {"enabled": True, "step": 1, "module_depth": -1, "top_modules": 3}},
    # a Hugging Face ZeRO-2 template with ZeRO-3 knobs left in and fp32 accumulation
    "hf_zero2": {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 2, "allgather_partitions": True, "overlap_comm": True,
                                       "reduce_scatter": True, "contiguous_gradients": True,
                                       "stage3_gather_16bit_weights_on_model_save": True},
                 "data_types": {"grad_accum_dtype": "fp32"}, "gradient_clipping": 1.0},
    # AdamW with DeepSpeed's adam_w_mode flag set the "wrong" way, which DeepSpeed ignores
    "adamw": {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "adam_w_mode": False}}},
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_deepspeed_configs_start(name, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(REAL_CONFIGS[name], indent=2))
    assert load_config(path).train_batch_size is not None
