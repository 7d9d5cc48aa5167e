"""Which DeepSpeed keys tachyon refuses, which it accepts and ignores, and the key walk.

Nothing is silently dropped. Every key in a config is one of:

- a field of a section model (`tachyon.config.sections`): validated and used;
- in `UNSUPPORTED_KEYS`: a DeepSpeed feature tachyon does not implement yet. It is refused
  unless its value leaves the feature off (``{"enabled": false}``, ``false``,
  ``{"device": "none"}``, ... see `OFF_VALUES`), in which case it is accepted and reported by
  `TachyonConfig.ignored_keys`;
- in `ACCEPTED_IGNORED_KEYS`: accepted with no effect (logging, debugging and performance hints
  whose result tachyon already matches, or ZeRO-3-only knobs), reported by ``ignored_keys``;
- anything else: an error with a did-you-mean.

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
    "eigenvalue": "eigenvalue computation for MoQ",
    "quantize_training.eigenvalue": "eigenvalue-adaptive MoQ quantization periods",
    "wandb": "Weights & Biases monitoring; use tensorboard or csv_monitor",
    "comet": "Comet monitoring; use tensorboard or csv_monitor",
    "nebula": "Nebula checkpointing",
    "hybrid_engine": "the RLHF hybrid engine",
    "sequence_parallel_size": "Ulysses sequence parallelism",
    "sparse_gradients": "sparse (CSR) embedding gradients",
    "disable_allgather": "broadcast instead of allgather",
    "dataloader_drop_last": "the engine-built dataloader",
    "graph_harvesting": "CUDA graph harvesting",
    "compile": "DeepCompile",
    "weight_quantization": "weight quantization at training time",
    "use_data_before_expert_parallelism": "expert (MoE) parallelism",
    # fp16 / bf16
    "fp16.auto_cast": "automatic casting of inputs to fp16",
    "fp16.fp16_master_weights_and_grads": "fp16 master weights and gradients",
    "bf16.check_overflow": "overflow checks in bf16",
    "bf16.bf16_master_weights_and_grads": "bf16 master weights and gradients",
    "bf16.bf16_optimizer_states": "bf16 optimizer states",
    # ZeRO
    "zero_optimization.stage": "ZeRO stage 3",
    "zero_optimization.offload_optimizer": "ZeRO-Offload of optimizer states",
    "zero_optimization.offload_param": "ZeRO-Offload of parameters",
    "zero_optimization.cpu_offload": "ZeRO-Offload of optimizer states",
    "zero_optimization.cpu_offload_param": "ZeRO-Offload of parameters",
    "zero_optimization.cpu_offload_use_pin_memory": "ZeRO-Offload",
    "zero_optimization.stage3_*": "ZeRO stage 3",
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
    # checkpoint
    "checkpoint.load_universal": "universal checkpoints",
    "checkpoint.parallel_write": "parallel checkpoint writes of pipeline stages",
    "checkpoint.writer": "DeepSpeed's checkpoint writers",
}
"""Dotted key path -> the DeepSpeed feature tachyon does not implement yet."""

ACCEPTED_IGNORED_KEYS: tuple[str, ...] = (
    "dump_state",
    "memory_breakdown",
    "vocabulary_size",
    "timers",
    "seq_parallel_communication_data_type",
    "optimizer.legacy_fusion",
    "quantize_training.quantizer_kernel",
    "bf16.immediate_grad_update",
    "zero_optimization.allgather_partitions",
    "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.log_trace_cache_warnings",
    "zero_optimization.enable_sanity_checks",
    "zero_optimization.sub_group_size",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.pipeline_loading_checkpoint",
    "zero_optimization.override_module_apply",
    "zero_optimization.leaf_module",
    "pipeline.pipe_partitioned",
    "pipeline.grad_partitioned",
)
"""Dotted key paths accepted with any value and no effect."""


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(x) and v == x or v is x for x in values)


def _disabled(v: Any) -> bool:
    return v is None or v is False or (isinstance(v, dict) and v.get("enabled") is False)


def _no_offload(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and str(v.get("device", "")).lower() == "none")


_DISABLED = (_disabled, '{"enabled": false}')
_FALSE = (_is(False, None), "false")

OFF_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: _DISABLED for key in (
        "amp", "torch_autocast", "comms_logger",
        "curriculum_learning", "data_efficiency", "elasticity", "autotuning", "eigenvalue", "quantize_training.eigenvalue",
        "wandb", "comet", "nebula", "hybrid_engine", "weight_quantization",
    )},
    **{key: _FALSE for key in (
        "sparse_gradients", "disable_allgather", "dataloader_drop_last", "graph_harvesting",
        "use_data_before_expert_parallelism", "fp16.fp16_master_weights_and_grads",
        "bf16.check_overflow", "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states", "zero_optimization.cpu_offload",
        "zero_optimization.cpu_offload_param", "zero_optimization.cpu_offload_use_pin_memory",
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
    "zero_optimization.offload_optimizer": (_no_offload, '{"device": "none"}'),
    "zero_optimization.offload_param": (_no_offload, '{"device": "none"}'),
    "zero_optimization.zero_hpz_partition_size": (_is(1), "1"),
    "zero_optimization.mics_shard_size": (_is(-1), "-1"),
    "zero_optimization.load_from_fp32_weights": (_is(True), "true"),
    "checkpoint.parallel_write": (
        lambda v: v == {} or v == {"pipeline_stage": False}, '{"pipeline_stage": false}'),
    # Keys that are also model fields: only the refused value is caught here, anything else
    # goes on to type checking.
    "fp16.auto_cast": (lambda v: v is not True, "false"),
    "checkpoint.load_universal": (lambda v: v is not True, "false"),
    "zero_optimization.stage": (lambda v: not (type(v) is int and v == 3), "0, 1 or 2"),
}  # fmt: skip
"""Dotted key path in `UNSUPPORTED_KEYS` -> (accepts a value that leaves the feature off, how
to write such a value)."""


def _lookup_unsupported(path: str) -> str | None:
    if path in UNSUPPORTED_KEYS:
        return path
    for pattern in UNSUPPORTED_KEYS:
        if pattern.endswith("*") and path.startswith(pattern[:-1]):
            return pattern
    return None


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
                if path == "zero_optimization.stage":
                    problems.append(
                        "ZeRO stage 3 is not supported yet (`zero_optimization.stage: 3`); "
                        "tachyon implements ZeRO stages 0, 1 and 2"
                    )
                else:
                    in_fields = key in by_key
                    problems.append(
                        not_supported(path, UNSUPPORTED_KEYS[pattern],
                                      value if in_fields or off_text else None, off_text)
                    )  # fmt: skip
                continue
            if key not in by_key:
                ignored[path] = value
                continue
        elif path in ACCEPTED_IGNORED_KEYS:
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
