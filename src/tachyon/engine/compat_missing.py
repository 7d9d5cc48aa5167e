"""What a missing engine attribute says: DeepSpeed's engine names tachyon does not provide.

``engine.<name>`` first finds the engine's own attributes (`tachyon.engine.compat_surface` holds
the DeepSpeed-shaped ones), then the wrapped model's (DeepSpeed's pass-through: an attribute the
engine lacks, such as a model method ``engine.generate``, is the model's). A name neither has
raises `EngineAttributeError`: for a DeepSpeedEngine / PipelineEngine name tachyon leaves out,
the message names the feature behind it and what to use instead (`NOT_PROVIDED`); for any other
name it says that neither the engine nor the model has it, with a did-you-mean. The error is an
AttributeError (so ``hasattr`` and ``getattr(engine, name, default)`` keep working, as
integrations rely on) and a NotImplementedError.

`NOT_PROVIDED` covers every public method and attribute of DeepSpeed's DeepSpeedEngine and
PipelineEngine that tachyon's engine does not have (checked against DeepSpeed's source by
tests/compat/test_engine_surface.py).
"""

from __future__ import annotations

import difflib
from typing import Any

_MOE = ("mixture-of-experts layers (deepspeed.moe) are not implemented by tachyon", "dense layers")
_CURRICULUM = ("data efficiency (curriculum learning, data sampling, random-LTD) is not implemented by tachyon",
               "your own sampler or DataLoader (engine.deepspeed_io(dataset, data_sampler=...))")
_EIGEN = ("eigenvalue-adaptive MoQ is not implemented by tachyon",
          "quantize_training with fixed quantize periods (engine.quantizer)")
_AUTOTUNE = ("the autotuner is not implemented by tachyon", "`tachyon plan` to pick a layout")
_COMPILE = ("DeepCompile is not implemented by tachyon", "torch.compile(engine.module)")
_ZERO3 = ("ZeRO stage 3 / parameter partitioning is not implemented by tachyon (stages 0-2 are)",
          "zero_optimization.stage 0, 1 or 2; parameters are whole on every rank")
_OFFLOAD = ("ZeRO-Offload (optimizer or parameter states on CPU / NVMe) is not implemented by tachyon",
            "ZeRO stages 1-2 to shard optimizer states over the data-parallel ranks")
_REDUCE = ("DeepSpeed's internal gradient-reduction helpers are not part of tachyon's engine: its ZeRO strategy "
           "(engine.zero) reduces flat gradient buckets during backward",
           "engine.allreduce_gradients(), or torch.distributed on tensors of your own")
_TIMERS = ("DeepSpeed's timer objects are not provided",
           "the config's wall_clock_breakdown (the engine prints forward / backward / reduce / step times) or "
           "engine.telemetry.last_step")
_CKPT_INTERNAL = ("DeepSpeed's checkpoint internals are not provided (tachyon's checkpoints are "
                  "torch.distributed.checkpoint directories, docs/checkpoints.md)",
                  "engine.save_checkpoint / engine.load_checkpoint")
_SEQ = ("Ulysses sequence parallelism is not implemented by tachyon",
        "tensor_parallel.sequence_parallel (Megatron-style sequence parallelism within tensor parallelism)")
_PIPE_INTERNAL = ("DeepSpeed's pipeline-engine internals (buffers, activation-shape caches, per-stage "
                  "send/recv state) are not part of tachyon's pipeline, which runs on "
                  "torch.distributed.pipelining", "engine.train_batch() / engine.eval_batch() and their return values")
_MANUAL_SCALE = ("the PyTorch-style backward (engine.scale(loss).backward()) is not provided",
                 "engine.backward(loss)")
_HOOKS = ("DeepSpeed's module forward hooks for DeepCompile are not provided", "Module.register_forward_hook")
_CLIENT = ("the engine does not keep the objects passed to initialize separately",
           "engine.optimizer / engine.lr_scheduler / engine.training_dataloader")

NOT_PROVIDED: dict[str, tuple[str, str]] = {
    **dict.fromkeys((
        "print_forward_breakdown", "load_moe_state_dict", "all_to_all_group", "local_all_to_all_group",
        "expert_data_parallel_group", "expert_parallel_group", "get_additional_losses", "agg_additional_losses",
        "total_additional_losses"), _MOE),
    **dict.fromkeys((
        "set_data_post_process_func", "set_custom_curriculum_learning_schedule", "curriculum_params_legacy",
        "data_efficiency_config", "data_sampling_config", "curriculum_learning_config", "random_ltd_config",
        "random_ltd_initialize", "curriculum_scheduler_legacy", "random_ltd_scheduler"), _CURRICULUM),
    **dict.fromkeys((
        "eigenvalue_verbose", "eigenvalue_max_iter", "eigenvalue_tol", "eigenvalue_stability",
        "eigenvalue_gas_boundary_resolution", "eigenvalue_layer_name", "eigenvalue_layer_num", "eigenvalue",
        "block_eigenvalue", "compression_scheduler"), _EIGEN),
    **dict.fromkeys((
        "autotuning_start_profile_step", "autotuning_end_profile_step", "autotuning_metric_path",
        "autotuning_model_info_path", "autotuning_metric", "autotuning_profile_model_info", "autotuning_model_info",
        "flops", "fwd_duration"), _AUTOTUNE),
    **dict.fromkeys((
        "compile", "compile_zero_optimization_stage", "compile_autosp", "compile_autotp",
        "uses_parallelization_pass_only", "get_autosp_backend", "get_autotp_backend", "get_deepcompile_backend",
        "get_deepspeed_compile_backend", "get_compile_time", "register_compile_pass", "is_deepcompile_enabled",
        "is_deepcompile_active", "is_compiled"), _COMPILE),
    **dict.fromkeys(("module_forward_pre_hook", "module_forward_post_hook"), _HOOKS),
    **dict.fromkeys((
        "zero_max_live_parameters", "zero_max_reuse_distance", "zero_prefetch_bucket_size",
        "zero_module_granularity_threshold", "zero_param_persistence_threshold", "zero_model_persistence_threshold",
        "empty_partition_cache", "is_first_weights_partition_group", "mics_shard_size", "zero_hpz_partition_size",
        "zero_allgather_sequential", "zero_save_muon_momentum_buffer_in_memory", "zero_multi_rank_bucket_allreduce",
        "zero_log_trace_cache_warnings", "zeropp_loco_param"), _ZERO3),
    **dict.fromkeys((
        "offload_states", "reload_states", "zero_partial_offload", "super_offload", "cpuadam_cores_perc",
        "zero_nvme_offload_optimizer", "swap_tensor_config", "aio_config", "zenflow_config", "zero_sub_group_size",
        "update_interval", "optimized_linear_base_weight_sharding", "optimized_linear_lora_enabled"), _OFFLOAD),
    **dict.fromkeys((
        "allreduce_bucket", "allreduce_and_copy", "allreduce_no_retain", "buffered_allreduce_fallback",
        "sparse_allreduce_no_retain", "sparse_allreduce_bucket", "sparse_allreduce", "sparse_all_gather",
        "all_gather_scalar", "coalesce_grad_reduction", "dp_group_loss"), _REDUCE),
    **dict.fromkeys((
        "timers", "tput_timer", "engine_timers", "engine_timers_cache", "get_wall_clock_timers", "batch_timer",
        "tput_log", "log_for_device", "summary_events", "log_batch_step_id"), _TIMERS),
    **dict.fromkeys((
        "checkpoint_engine", "checkpoint_serialization_enabled", "checkpoint_writer_enabled",
        "loaded_checkpoint_mp_world_size", "loaded_checkpoint_dp_world_size", "save_non_zero_checkpoint",
        "save_zero_checkpoint", "checkpoint_mp_rank", "load_module_state_dict"), _CKPT_INTERNAL),
    **dict.fromkeys(("get_sequence_parallel_group", "seq_parallel_group", "seq_data_parallel_group"), _SEQ),
    **dict.fromkeys((
        "set_has_attention_mask", "has_attention_mask", "reset_activation_shape", "set_batch_fn", "batch_fn",
        "pipe_buffers", "num_pipe_buffers", "pipe_recv_buf", "meta_buffer", "first_output_send",
        "first_gradient_send", "grad_layer", "grad_partition_grad_layer_meta_cache",
        "pipe_partition_grad_meta_cache", "pipe_partition_input_meta_cache", "pipe_partition_output_meta_cache",
        "is_pipe_partitioned", "is_grad_partitioned", "has_bool_tensors", "dynamic_shape", "fwd_outputs",
        "outputs", "loss_model", "next_stage", "prev_stage", "total_loss", "agg_loss", "agg_train_loss", "loss",
        "eval_return_logits", "pipeline_enable_backward_allreduce", "using_bf16_optimizer", "grid"), _PIPE_INTERNAL),
    **dict.fromkeys(("scale", "scale_wrt_gas", "losses"), _MANUAL_SCALE),
    **dict.fromkeys(("client_optimizer", "client_lr_scheduler", "collate_fn"), _CLIENT),
    "mesh_device": ("the engine's layout is a tachyon Mesh, not a bare DeviceMesh", "engine.mesh (its .device_mesh)"),
    "quantize_training": ("DeepSpeed's tuple of MoQ settings is not provided",
                          "engine.config.quantize_training and engine.quantizer"),
    "zero_grad_hooks": ("ZeRO's gradient hooks are always on in tachyon", "nothing (they are on)"),
    "first_dataloader_check": ("DeepSpeed's dataloader bookkeeping is not provided", "engine.training_dataloader"),
}
"""DeepSpeed engine name -> (why tachyon's engine does not provide it, what to use instead)."""


class EngineAttributeError(AttributeError, NotImplementedError):
    """An engine attribute that is not there: an AttributeError (``hasattr`` is False) whose
    message names the engine, not the wrapped model."""


def missing_attribute(engine: Any, name: str, model: Any) -> EngineAttributeError:
    """The error for ``engine.<name>`` when neither the engine nor ``model`` has it."""
    if name in NOT_PROVIDED:
        why, instead = NOT_PROVIDED[name]
        return EngineAttributeError(
            f"engine.{name} (DeepSpeed's engine attribute) is not provided by tachyon's Engine: {why}; use {instead}. "
            "docs/engine.md lists what the engine provides", name=name, obj=engine)
    known = [n for n in dir(type(engine)) if not n.startswith("_")]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean engine.{close[0]}?" if close else ""
    return EngineAttributeError(
        f"tachyon's Engine has no attribute {name!r}, and the model it wraps ({type(model).__name__}) has none "
        f"either.{hint} docs/engine.md lists the engine's attributes", name=name, obj=engine)


__all__ = ["NOT_PROVIDED", "EngineAttributeError", "missing_attribute"]
