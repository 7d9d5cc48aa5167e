"""Which DeepSpeed keys tachyon refuses, which it accepts and ignores, and the key walk.

Nothing is silently dropped. Every key in a config is one of:

- a field of a section model (`tachyon.config.sections`): validated and used;
- in `UNSUPPORTED_KEYS`: a DeepSpeed feature tachyon does not implement yet. It is refused
  unless its value leaves the feature off (``{"enabled": false}``, ``false``,
  ``{"device": "none"}``, ... see `OFF_VALUES`), in which case it is accepted and reported by
  `TachyonConfig.ignored_keys`;
- in `ACCEPTED_IGNORED_KEYS`: accepted with no effect (logging, debugging and performance hints
  whose result tachyon already matches, ZeRO-3-only knobs, and keys DeepSpeed itself does not
  read that real configs carry), reported by ``ignored_keys``; the table gives each one's reason;
- anything else: an error with a did-you-mean.

Every key DeepSpeed reads in the sections tachyon implements is one of the first three (checked
against DeepSpeed's config classes by tests/config/test_deepspeed_keys.py).

Paths are dotted (``zero_optimization.offload_optimizer``); a trailing ``*`` matches a prefix.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from .errors import join_path, not_supported, render, unknown_key

UNSUPPORTED_KEYS: dict[str, str] = {
    # top-level features
    "sparse_attention": "sparse attention",
    "amp": "Apex AMP; use fp16 or bf16",
    "torch_autocast": "torch.autocast mixed precision; use fp16 or bf16",
    "comms_logger": "the communication logger",
    "compression_training": "compression training",
    "curriculum_learning": "legacy curriculum learning",
    "data_efficiency": "data efficiency (curriculum learning, random-LTD)",
    "elasticity": "elastic training",
    "autotuning": "the autotuner",
    "aio": "async I/O for NVMe offload",
    "eigenvalue": "eigenvalue computation for MoQ; DeepSpeed reads it only as quantize_training.eigenvalue and "
                  "ignores this top-level section, so removing it changes nothing",
    "quantize_training.eigenvalue": "eigenvalue-adaptive MoQ quantization periods",
    "wandb": "Weights & Biases monitoring; use tensorboard or csv_monitor",
    "comet": "Comet monitoring; use tensorboard or csv_monitor",
    "nebula": "Nebula checkpointing",
    "hybrid_engine": "the RLHF hybrid engine",
    "sequence_parallel_size": "Ulysses sequence parallelism",
    "sparse_gradients": "sparse (CSR) embedding gradients",
    "disable_allgather": "broadcast instead of allgather",
    "graph_harvesting": "CUDA graph harvesting",
    "compile": "DeepCompile",
    "weight_quantization": "weight quantization at training time",
    "use_data_before_expert_parallelism": "expert (MoE) parallelism",
    "gradient_allreduce_op": "summing gradients over the data-parallel ranks instead of averaging them",
    "managed_gradient_accumulation": "unmanaged gradient accumulation (every step() a boundary); use "
                                     "engine.set_gradient_accumulation_boundary",
    # fp16 / bf16
    "fp16.auto_cast": "automatic casting of inputs to fp16",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights and gradients",
    "bf16.check_overflow": "overflow checks in bf16",
    "bf16.bf16_master_weights_and_grads": "bf16 master weights and gradients",
    "bf16.bf16_optimizer_states": "bf16 optimizer states",
    # ZeRO
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hierarchical partitioning",
    "zero_optimization.zero_quantized_weights": "ZeRO++ quantized weights",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ quantized weights",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ quantized gradients",
    "zero_optimization.zeropp_loco_param": "LoCo ZeRO++",
    "zero_optimization.mics_shard_size": "MiCS",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS",
    "zero_optimization.legacy_stage1": "the legacy ZeRO stage 1 implementation",
    "zero_optimization.elastic_checkpoint": "elastic ZeRO checkpoints",
    "zero_optimization.load_from_fp32_weights": "rebuilding fp32 master weights from 16-bit ones",
    "zero_optimization.zenflow": "ZenFlow",
    # tensor parallelism (AutoTP)
    "tensor_parallel.tp": "AutoTP's nested tp block; set tensor_parallel.tp_size",
    "tensor_parallel.tp_grain_size": "AutoTP's split granularity",
    "tensor_parallel.tp_overlap_comm": "AutoTP's communication overlap",
    "tensor_parallel.partition_config": "AutoTP's custom partition rules (tachyon.parallel.tensor.parallelize has "
                                        "its own policies)",
    "tensor_parallel.preset_model": "AutoTP's preset model partitions",
    "tensor_parallel.keep_module_on_host": "keeping AutoTP modules on the host",
    # checkpoint
    "checkpoint.load_universal": "universal checkpoints",
    "checkpoint.parallel_write": "parallel checkpoint writes of pipeline stages",
    "checkpoint.writer": "DeepSpeed's checkpoint writers",
}
"""Dotted key path -> the DeepSpeed feature tachyon does not implement yet."""

_HINT = "a logging / debugging switch with no effect on training"
_STAGE3 = "at stage 3 (torch's FSDP2): "
_ZERO3_ONLY = "a DeepSpeed ZeRO-3 / offload implementation detail with no counterpart in FSDP2 or tachyon's stages 0-2"
_OFFLOAD_KNOB = "a DeepSpeed NVMe / swap-buffer setting; tachyon offloads to host memory only (device cpu)"
_NOT_READ = "not read by DeepSpeed either (it ignores unknown keys in this section); found in real configs"
_ZERO3_REASONS = {
    "param_persistence_threshold": _STAGE3 + "every parameter is sharded; small ones (norms, biases) travel in their "
                                   "block's single all-gather, so keeping them whole would save no collective",
    "model_persistence_threshold": _STAGE3 + "every parameter is sharded (see stage3_param_persistence_threshold)",
    "max_live_parameters": _STAGE3 + "FSDP2 frees a block's gathered parameters after its forward and after its "
                           "backward, so at most the running block and the prefetched one are whole at a time",
    "max_reuse_distance": _STAGE3 + "FSDP2 re-gathers a block for its backward (the root's parameters stay "
                          "gathered from forward to backward); there is no reuse window to tune",
    "gather_16bit_weights_on_model_save": "engine.save_16bit_model always writes the consolidated weights: at stage 3 "
                                          "it gathers one parameter at a time onto rank 0, so no rank ever holds the "
                                          "whole model",
    "gather_fp16_weights_on_model_save": "the older name of stage3_gather_16bit_weights_on_model_save: "
                                         "engine.save_16bit_model always writes the consolidated weights",
    "module_granularity_threshold": _STAGE3 + "the sharded units are the transformer blocks (docs/zero.md), not "
                                    "chosen by size",
    "use_all_reduce_for_fetch_params": _STAGE3 + "FSDP2 gathers parameters with all-gather",
    "allgather_sequential": _STAGE3 + "FSDP2 gathers a block's parameters in one all-gather",
}

ACCEPTED_IGNORED_KEYS: dict[str, str] = {
    "dump_state": _HINT,
    "memory_breakdown": _HINT + " (tachyon reports memory with engine.memory_breakdown())",
    "log_level": _HINT + " (configure the 'tachyon' / 'DeepSpeed' loggers instead)",
    "vocabulary_size": "used by DeepSpeed only for its own bookkeeping",
    "timers": "DeepSpeed's throughput-timer settings; wall_clock_breakdown and steps_per_print set tachyon's",
    "seq_parallel_communication_data_type": "Ulysses sequence parallelism's dtype (tachyon has none: sequence_parallel_size is 1)",
    "optimizer.legacy_fusion": "an old fp16 optimizer switch; tachyon's fp16 path has one implementation",
    "quantize_training.quantizer_kernel": "MoQ's CUDA quantizer switch; tachyon's quantizer is one implementation",
    "quantize_training.quantize_type": _NOT_READ,
    "quantize_training.quantize_eigenvalue": _NOT_READ,
    "flops_profiler.step": _NOT_READ + " (profile_step sets the step to profile)",
    "cuda_visible_devices": _NOT_READ + " (set CUDA_VISIBLE_DEVICES in the environment)",
    "bf16.immediate_grad_update": "a DeepSpeed bf16-optimizer scheduling detail; tachyon's result is the same",
    "zero_optimization.allgather_partitions": "tachyon always all-gathers (DeepSpeed's default true)",
    "zero_optimization.use_multi_rank_bucket_allreduce": "a DeepSpeed reduction-scheduling detail",
    "zero_optimization.ignore_unused_parameters": "parameters without gradients are always allowed",
    "zero_optimization.log_trace_cache_warnings": _HINT,
    "zero_optimization.enable_sanity_checks": _HINT,
    "zero_optimization.sub_group_size": "DeepSpeed steps the optimizer in sub-groups to bound its offload buffers; "
                                        "tachyon steps every local shard in one fused call",
    "zero_optimization.memory_efficient_linear": _ZERO3_ONLY,
    "zero_optimization.pipeline_loading_checkpoint": _ZERO3_ONLY,
    "zero_optimization.override_module_apply": _ZERO3_ONLY,
    "zero_optimization.leaf_module": _ZERO3_ONLY,
    "zero_optimization.save_muon_momentum_buffer_in_memory": "the Muon optimizer's setting (tachyon has no Muon)",
    **{f"zero_optimization.stage3_{key}": why for key, why in _ZERO3_REASONS.items()},
    **{f"zero_optimization.{key}": why for key, why in _ZERO3_REASONS.items()},
    **{f"zero_optimization.offload_optimizer.{key}": _OFFLOAD_KNOB for key in (
        "buffer_count", "fast_init", "nvme_path", "pipeline", "pipeline_read", "pipeline_write")},
    **{f"zero_optimization.offload_param.{key}": _OFFLOAD_KNOB for key in (
        "buffer_count", "buffer_size", "max_in_cpu", "nvme_path")},
    "pipeline.pipe_partitioned": "DeepSpeed's activation partitioning between stages; torch.distributed.pipelining "
                                 "sends whole activations",
    "pipeline.grad_partitioned": "as pipe_partitioned, for gradients",
}
"""Dotted key path (a trailing ``*`` matches a prefix) -> why it is accepted with no effect."""


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(x) and v == x or v is x for x in values)


def _disabled(v: Any) -> bool:
    return v is None or v is False or (isinstance(v, dict) and v.get("enabled") is False)


_DISABLED = (_disabled, '{"enabled": false}')
_FALSE = (_is(False, None), "false")

OFF_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: _DISABLED for key in (
        "amp", "torch_autocast", "comms_logger",
        "curriculum_learning", "data_efficiency", "elasticity", "autotuning", "eigenvalue", "quantize_training.eigenvalue",
        "wandb", "comet", "nebula", "hybrid_engine", "weight_quantization",
    )},
    **{key: _FALSE for key in (
        "sparse_gradients", "disable_allgather", "graph_harvesting",
        "use_data_before_expert_parallelism", "fp16.fp16_master_weights_and_grads",
        "bf16.check_overflow", "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states",
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_quantized_nontrainable_weights",
        "zero_optimization.zero_quantized_gradients",
        "zero_optimization.mics_hierarchical_params_gather", "zero_optimization.legacy_stage1",
        "zero_optimization.elastic_checkpoint", "zero_optimization.zeropp_loco_param",
        "zero_optimization.zenflow",
    )},
    "sequence_parallel_size": (_is(1), "1"),
    "compile": (lambda v: v == {} or (isinstance(v, dict) and v.get("deepcompile") is False),
                '{"deepcompile": false}'),
    "gradient_allreduce_op": (lambda v: isinstance(v, str) and v.lower() == "mean", '"mean"'),  # any case, as DeepSpeed
    "managed_gradient_accumulation": (_is(True), "true"),
    "tensor_parallel.tp": (lambda v: v == {} or v is None, "{}"),
    "tensor_parallel.tp_grain_size": (_is(1), "1"),
    "tensor_parallel.tp_overlap_comm": (_is(False, None), "false"),
    "tensor_parallel.partition_config": (_is(None), "null"),
    "tensor_parallel.preset_model": (_is(None), "null"),
    "tensor_parallel.keep_module_on_host": (_is(False, None), "false"),
    "zero_optimization.zero_hpz_partition_size": (_is(1), "1"),
    "zero_optimization.mics_shard_size": (_is(-1), "-1"),
    "zero_optimization.load_from_fp32_weights": (_is(True), "true"),
    "checkpoint.parallel_write": (
        lambda v: v == {} or v == {"pipeline_stage": False}, '{"pipeline_stage": false}'),
    # Keys that are also model fields: only the refused value is caught here, anything else
    # goes on to type checking.
    "fp16.auto_cast": (lambda v: v is not True, "false"),
    "checkpoint.load_universal": (lambda v: v is not True, "false"),
}  # fmt: skip
"""Dotted key path in `UNSUPPORTED_KEYS` -> (accepts a value that leaves the feature off, how
to write such a value)."""


def _lookup(path: str, table: dict[str, str]) -> str | None:
    """The entry of ``table`` (exact path, or a ``prefix*`` pattern) that ``path`` falls under."""
    if path in table:
        return path
    for pattern in table:
        if pattern.endswith("*") and path.startswith(pattern[:-1]):
            return pattern
    return None


def _lookup_unsupported(path: str) -> str | None:
    return _lookup(path, UNSUPPORTED_KEYS)


def ignored_reason(path: str) -> str | None:
    """Why ``path`` is accepted with no effect, or None when it is not such a key."""
    pattern = _lookup(path, ACCEPTED_IGNORED_KEYS)
    return None if pattern is None else ACCEPTED_IGNORED_KEYS[pattern]


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model in ``X`` or ``X | None``, else None."""
    candidates = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = list(typing.get_args(annotation))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _known_keys(prefix: str) -> list[str]:
    """Keys in the tables that live directly under ``prefix`` (for did-you-mean)."""
    known = []
    for path in (*UNSUPPORTED_KEYS, *ACCEPTED_IGNORED_KEYS):
        parent, _, key = path.rpartition(".")
        if parent == prefix and not key.endswith("*"):
            known.append(key)
    return known


def _not_a_section(path: str, value: Any) -> str:
    if path == "zero_optimization" and isinstance(value, bool):
        return (
            f"`zero_optimization: {str(value).lower()}` is DeepSpeed's legacy form; write the "
            'section as an object, e.g. "zero_optimization": {"stage": 1}'
        )
    return f"`{path}` should be a JSON object (a section of keys); got {render(value)}"


def walk(
    raw: dict[str, Any],
    model: type[BaseModel],
    prefix: str,
    ignored: dict[str, Any],
    problems: list[str],
) -> dict[str, Any]:
    """Check every key of ``raw`` against ``model`` and the tables; return the keys to validate.

    Refused and unknown keys add to ``problems``; accepted-but-ignored keys go into ``ignored``
    (path -> value). Sections (fields whose type is a model) are walked recursively.
    """
    fields = model.model_fields
    by_key = {(info.alias or name): name for name, info in fields.items()}  # JSON key -> field
    cleaned: dict[str, Any] = {}
    for key, value in raw.items():
        path = join_path(prefix, key)
        if not isinstance(key, str):
            problems.append(f"config keys must be strings; got {render(key)} in `{prefix or '.'}`")
            continue
        pattern = _lookup_unsupported(path)
        if pattern is not None:
            is_off, off_text = OFF_VALUES.get(pattern, (lambda v: False, None))
            if not is_off(value):
                in_fields = key in by_key
                problems.append(
                    not_supported(path, UNSUPPORTED_KEYS[pattern],
                                  value if in_fields or off_text else None, off_text)
                )  # fmt: skip
                continue
            if key not in by_key:
                ignored[path] = value
                continue
        elif ignored_reason(path) is not None:
            ignored[path] = value
            continue
        if key not in by_key:
            problems.append(unknown_key(path, prefix, [*by_key, *_known_keys(prefix)]))
            continue
        field = fields[by_key[key]]
        section = _section_model(field.annotation)
        if section is not None and not (value is None and field.default is None):
            if not isinstance(value, dict):
                problems.append(_not_a_section(path, value))
                continue
            value = walk(value, section, path, ignored, problems)
        cleaned[key] = value
    return cleaned
