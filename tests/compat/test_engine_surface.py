"""The engine answers DeepSpeed's engine names: every public method and attribute of DeepSpeed's
DeepSpeedEngine and PipelineEngine either works with DeepSpeed's meaning or raises an error that
names the engine, says why and what to use instead (never an AttributeError about the model)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

import tachyon
import tachyon.compat.deepspeed as deepspeed
from tachyon.engine.compat_missing import NOT_PROVIDED, EngineAttributeError

pytestmark = pytest.mark.usefixtures("one_thread")

DEEPSPEED_COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
"""The DeepSpeed commit (0.19.6, 2026-08-22) the names below were read from: every public method
and every ``self.<name> =`` attribute of runtime/engine.py's DeepSpeedEngine and of
runtime/pipe/engine.py's PipelineEngine."""

DEEPSPEED_ENGINE_NAMES = """
aio_config all_gather_scalar all_to_all_group allreduce_and_copy allreduce_bucket allreduce_gradients
allreduce_no_retain amp_enabled amp_params autotp_size autotuning_enabled autotuning_end_profile_step
autotuning_metric autotuning_metric_path autotuning_model_info autotuning_model_info_path
autotuning_profile_model_info autotuning_start_profile_step backward basic_optimizer
bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled block_eigenvalue
buffered_allreduce_fallback checkpoint_engine checkpoint_mp_rank checkpoint_serialization_enabled
checkpoint_tag_validation_enabled checkpoint_tag_validation_fail checkpoint_writer_enabled clip_fp32_gradients
client_lr_scheduler client_optimizer coalesce_grad_reduction collate_fn communication_data_type compile
compile_autosp compile_autotp compile_zero_optimization_stage compression_scheduler config cpuadam_cores_perc
curriculum_enabled_legacy curriculum_learning_config curriculum_learning_enabled curriculum_params_legacy
curriculum_scheduler_legacy data_efficiency_config data_efficiency_enabled data_parallel_group
data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy device dist_backend
dont_change_device dp_world_size dump_state dynamic_loss_scale dynamic_loss_scale_args eigenvalue
eigenvalue_enabled eigenvalue_gas_boundary_resolution eigenvalue_layer_name eigenvalue_layer_num
eigenvalue_max_iter eigenvalue_stability eigenvalue_tol eigenvalue_verbose elasticity_enabled
empty_partition_cache enable_backward_allreduce engine_timers engine_timers_cache eval
expert_data_parallel_group expert_parallel_group first_dataloader_check flatten flops flops_profiler
flops_profiler_detailed flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file
flops_profiler_profile_step flops_profiler_recompute_fwd_factor flops_profiler_top_modules forward
fp16_auto_cast fp16_enabled fp16_master_weights_and_gradients fwd_duration gas_boundary_ctr gate_modules
get_autosp_backend get_autotp_backend get_batch_info get_compile_time get_data_parallel_rank get_data_types
get_deepcompile_backend get_deepspeed_compile_backend get_global_grad_norm get_lr get_model_parallel_rank
get_mom get_pld_theta get_sequence_parallel_group get_tensor_parallel_rank get_type get_wall_clock_timers
global_rank global_samples global_steps gradient_accumulation_steps gradient_average gradient_clipping
gradient_predivide_factor graph_harvesting has_moe_layers initial_dynamic_scale inside_no_sync_ctxt
is_compiled is_deepcompile_active is_deepcompile_enabled is_elastic_model_parallel_supported
is_first_weights_partition_group is_gradient_accumulation_boundary is_iterable_style_dataset
is_map_style_dataset is_sanity_checks_enabled load_checkpoint load_module_state_dict load_moe_state_dict
load_universal_checkpoint loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size local_all_to_all_group
local_rank log_level loss_scale losses lr_scheduler managed_gradient_accumulation memory_breakdown mesh_device
micro_steps mics_shard_size module_forward_post_hook module_forward_pre_hook module_state_dict moe_layers
monitor mp_world_size mpu no_sync num_experts offload_states optimized_linear_base_weight_sharding
optimized_linear_lora_enabled optimizer optimizer_legacy_fusion optimizer_name optimizer_params param_names
pipeline_parallelism pld_enabled pld_gamma pld_params pld_theta postscale_gradients print_forward_breakdown
progressive_layer_drop quantize_training quantizer random_ltd_config random_ltd_enabled random_ltd_initialize
random_ltd_scheduler register_compile_pass reload_states save_16bit_model save_checkpoint save_fp16_model
save_non_zero_checkpoint save_zero_checkpoint scale scale_wrt_gas scheduler_name scheduler_params
seq_data_parallel_group seq_dp_world_size seq_parallel_group sequence_parallel_size
set_custom_curriculum_learning_schedule set_data_post_process_func set_gradient_accumulation_boundary
set_train_batch_size set_train_micro_batch_size skipped_steps sparse_all_gather sparse_allreduce
sparse_allreduce_bucket sparse_allreduce_no_retain sparse_gradients_enabled sparse_tensor_module_names
step steps_per_print summary_events super_offload swap_tensor_config tensor_parallel_config timers
torch_autocast_dtype torch_autocast_enabled torch_autocast_lower_precision_safe_modules
torch_autocast_z0_gradscaler tput_timer train train_batch_size train_micro_batch_size_per_gpu training_data
training_dataloader unflatten update_interval use_ds_comm use_node_local_storage uses_parallelization_pass_only
warn_unscaled_loss was_step_applied wall_clock_breakdown world_size zenflow_config zero_allgather_bucket_size
zero_allgather_partitions zero_allgather_sequential zero_allow_untested_optimizer zero_contiguous_gradients
zero_cpu_offload zero_elastic_checkpoint zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save
zero_grad zero_grad_hooks zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1
zero_load_from_fp32_weights zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance
zero_model_persistence_threshold zero_module_granularity_threshold zero_multi_rank_bucket_allreduce
zero_nvme_offload_optimizer zero_offload_optimizer zero_offload_param zero_optimization
zero_optimization_partition_gradients zero_optimization_partition_weights zero_optimization_stage
zero_overlap_comm zero_param_persistence_threshold zero_partial_offload zero_prefetch_bucket_size
zero_quantized_gradients zero_quantized_nontrainable_weights zero_quantized_weights zero_reduce_bucket_size
zero_reduce_scatter zero_round_robin_gradients zero_save_muon_momentum_buffer_in_memory zero_sub_group_size
zero_use_cpu_optimizer zeropp_loco_param
""".split()

DEEPSPEED_PIPELINE_ENGINE_NAMES = """
agg_additional_losses agg_loss agg_train_loss batch_fn batch_timer data_iterator dp_group_loss dynamic_shape
eval_batch eval_return_logits first_gradient_send first_output_send fwd_outputs get_additional_losses
get_pipeline_parallel_rank grad_layer grad_partition_grad_layer_meta_cache grid has_attention_mask
has_bool_tensors is_data_parallel is_first_stage is_grad_partitioned is_last_stage is_model_parallel
is_pipe_parallel is_pipe_partitioned log_batch_step_id log_for_device loss loss_model meta_buffer
micro_batch_size micro_batches next_stage num_pipe_buffers num_stages outputs pipe_buffers
pipe_partition_grad_meta_cache pipe_partition_input_meta_cache pipe_partition_output_meta_cache pipe_recv_buf
pipeline_enable_backward_allreduce prev_stage reset_activation_shape set_batch_fn set_dataiterator
set_dataloader set_has_attention_mask stage_id summary_events total_additional_losses total_loss train_batch
tput_log using_bf16_optimizer
""".split()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_engine(**config):
    torch.manual_seed(0)
    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    engine, *_ = deepspeed.initialize(model=Net(), config={**base, **config})
    return engine


def micro_step(engine, seed=0):
    torch.manual_seed(seed)
    loss = engine(torch.randn(2, 4, device=engine.device)).square().mean()
    engine.backward(loss)
    engine.step()


def test_every_deepspeed_engine_name_is_provided_or_refused_with_a_reason():
    engine = make_engine()
    generic = []
    for name in DEEPSPEED_ENGINE_NAMES + DEEPSPEED_PIPELINE_ENGINE_NAMES:
        try:
            getattr(engine, name)
        except EngineAttributeError as error:
            message = str(error)
            assert f"engine.{name}" in message, message
            if "has none either" in message:
                generic.append(name)
            assert isinstance(error, AttributeError) and isinstance(error, NotImplementedError)
            assert not hasattr(engine, name)
    assert not generic, f"DeepSpeed names without a specific answer: {generic}"
    provided = [n for n in DEEPSPEED_ENGINE_NAMES if n not in NOT_PROVIDED]
    assert len(provided) >= 163, len(provided)  # 163 of the 280 DeepSpeedEngine names at DEEPSPEED_COMMIT
    assert set(NOT_PROVIDED) <= set(DEEPSPEED_ENGINE_NAMES + DEEPSPEED_PIPELINE_ENGINE_NAMES)


def test_unknown_attribute_blames_neither_model_alone_and_suggests():
    engine = make_engine()
    with pytest.raises(AttributeError) as info:
        engine.loacl_rank  # noqa: B018
    message = str(info.value)
    assert "tachyon's Engine has no attribute 'loacl_rank'" in message and "(Net)" in message
    assert "Did you mean engine.local_rank?" in message
    assert "'Net' object has no attribute" not in message
    assert engine.fc1 is engine.module.fc1, "the model's own attributes still pass through"
    with pytest.raises(NotImplementedError, match=r"engine.offload_states .*ZeRO-Offload"):
        engine.offload_states()


def test_ranks_sizes_and_precision_queries(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine = make_engine(bf16={"enabled": True}, zero_optimization={"stage": 1})
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert (engine.dp_world_size, engine.mp_world_size, engine.seq_dp_world_size) == (1, 1, 1)
    assert engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.zero_optimization_stage() == 1 and engine.zero_optimization() is True
    assert not engine.zero_optimization_partition_gradients() and engine.zero_offload_optimizer() is None
    assert engine.get_data_types() == (torch.bfloat16, torch.bfloat16)
    assert engine.communication_data_type == torch.bfloat16
    assert engine.optimizer_name() == "adam" and engine.optimizer_params()["lr"] == 0.01
    assert engine.get_mom() == [(0.9, 0.999)] and engine.get_lr() == [0.01]
    assert engine.gradient_clipping() == 0.0 and engine.steps_per_print() == 10
    assert engine.get_batch_info() == (4, 2, 2)
    fp16 = make_engine(fp16={"enabled": True, "initial_scale_power": 8})
    assert fp16.fp16_enabled() and fp16.dynamic_loss_scale() and fp16.initial_dynamic_scale() == 256.0
    assert fp16.loss_scale == 256.0 and fp16.loss_scale() == 0.0, "current scale; called: the config's static one"
    assert fp16.dynamic_loss_scale_args()["init_scale"] == 256


def test_step_bookkeeping_and_was_step_applied():
    engine = make_engine()
    applied, samples = [], []
    for micro in range(4):
        micro_step(engine, micro)
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
    assert applied == [False, True, False, True]
    assert samples == [0, 4, 4, 8] and engine.global_steps == 2 and engine.micro_steps == 4
    assert engine.optimizer.optimizer is engine.optimizer and engine.optimizer.overflow is False


def test_an_fp16_overflow_step_is_not_applied_but_counts_samples():
    engine = make_engine(train_batch_size=2, fp16={"enabled": True, "initial_scale_power": 8})
    loss = engine(torch.randn(2, 4, dtype=torch.half)).float().sum() * float("inf")
    engine.backward(loss)
    engine.step()
    assert not engine.was_step_applied() and engine.optimizer.overflow is True
    assert engine.skipped_steps == 1 and engine.global_samples == 2


def test_manual_accumulation_boundary_steps_once():
    engine = make_engine()
    before = engine.module.fc1.weight.detach().clone()
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    assert not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    assert not torch.equal(before, engine.module.fc1.weight)
    with pytest.raises(TypeError, match="bool"):
        engine.set_gradient_accumulation_boundary(1)


def test_step_passes_lr_kwargs_to_the_scheduler():
    seen = []

    class Sched:
        def step(self, **kwargs):
            seen.append(kwargs)

        def state_dict(self):
            return {}

    torch.manual_seed(0)
    engine, *_ = tachyon.initialize(model=Net(), config={"train_batch_size": 2},
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), lr_scheduler=Sched())
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step(lr_kwargs={"increment": 3})
    assert seen == [{"increment": 3}] and isinstance(engine.lr_scheduler, Sched)


def test_set_train_batch_size_changes_accumulation_and_keeps_samples_continuous():
    engine = make_engine()
    for micro in range(2):
        micro_step(engine, micro)
    engine.set_train_batch_size(8)
    assert engine.gradient_accumulation_steps() == 4 and engine.train_batch_size() == 8
    for micro in range(4):
        micro_step(engine, micro)
    assert engine.global_steps == 2 and engine.global_samples == 4 + 8
    with pytest.raises(ValueError, match="multiple"):
        engine.set_train_batch_size(5)
    engine.set_train_micro_batch_size(1)
    assert engine.get_batch_info() == (4, 1, 4)


def test_deepspeed_io_routes_and_eval_does_not_shuffle():
    engine = make_engine()
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    train = engine.deepspeed_io(data)
    evaluate = engine.deepspeed_io(data, route="eval", batch_size=4)
    assert train.batch_size == 2 and train.sampler.shuffle
    assert not evaluate.sampler.shuffle and [b[0].tolist() for b in evaluate] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="route"):
        engine.deepspeed_io(data, route="test")


def test_no_sync_is_refused_where_zero_partitions_gradients_and_forbids_step():
    with pytest.raises(RuntimeError, match="ZeRO stage 2"):
        with make_engine(zero_optimization={"stage": 2}).no_sync():
            pass
    engine = make_engine(train_batch_size=2)
    with engine.no_sync():
        assert engine.inside_no_sync_ctxt
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.step()
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    assert engine.was_step_applied()


def test_module_state_dict_and_getters_of_absent_features_answer_off():
    engine = make_engine()
    assert set(engine.module_state_dict()) == set(engine.module.state_dict())
    assert engine.eigenvalue_enabled() is False and engine.zero_cpu_offload() is False
    assert engine.param_names[engine.module.fc1.weight] == "fc1.weight"
    assert engine.monitor.enabled is False and engine.flatten([torch.ones(2), torch.zeros(1)]).tolist() == [1, 1, 0]
    with pytest.raises(AttributeError, match="flops_profiler section is enabled"):
        engine.flops_profiler  # noqa: B018
    profiled = make_engine(flops_profiler={"enabled": True})
    assert profiled.flops_profiler is profiled.flops_profiler


def test_offload_getters_read_the_config_including_deepspeeds_older_spelling():
    plain = make_engine(zero_optimization={"stage": 1})
    assert plain.zero_offload_optimizer() is None and plain.zero_offload_param() is None
    assert not plain.zero_optimization_partition_weights()
    engine = make_engine(zero_optimization={"stage": 1, "cpu_offload": True})
    assert engine.zero_cpu_offload() is True and engine.zero_use_cpu_optimizer() is True
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_offload_param() is None
    micro_step(engine)
    micro_step(engine, seed=1)
    assert engine.global_steps == 1


def test_cifar_style_script_lines_run(tmp_path):
    """The first lines a DeepSpeedExamples CIFAR script runs against the engine."""
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}')
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed_config", str(config)])
    model = Net()
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    local_device = model_engine.device
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else (
        torch.half if model_engine.fp16_enabled() else None)
    assert target_dtype is None and model_engine.local_rank == int(os.environ.get("LOCAL_RANK", 0))
    inputs = torch.randn(4, 4).to(local_device)
    model_engine.backward(model_engine(inputs).square().mean())
    model_engine.step()
    assert model_engine.was_step_applied()


def test_deprecated_deepscale_config_in_args_is_read_as_deepspeed_config(tmp_path):
    """DeepSpeed reads args.deepscale_config (its old name, with a warning) where deepspeed_config is
    unset, and refuses both at once."""
    config = tmp_path / "ds.json"
    config.write_text('{"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}')
    args = argparse.Namespace(deepscale_config=str(config), local_rank=0)
    model = Net()
    with pytest.warns(DeprecationWarning, match="deepscale_config is deprecated"):
        engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.train_batch_size() == 4
    both = argparse.Namespace(deepscale_config=str(config), deepspeed_config=str(config))
    with pytest.raises(ValueError, match="both deepscale_config"):
        deepspeed.initialize(args=both, model=Net(), model_parameters=Net().parameters())
