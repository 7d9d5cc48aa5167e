"""init_inference's arguments (DeepSpeed-Inference's names), validated before any weight moves.

    tachyon.init_inference(model, dtype=torch.float16, tensor_parallel={"tp_size": 2},
                           replace_with_kernel_inject=True, max_out_tokens=1024,
                           quant={"enabled": True, "weight": {"num_bits": 8, "group_size": 128}})
    tachyon.init_inference(model, config={"dtype": "fp16", "mp_size": 2})      # the dict form

Every argument may also come in ``config=`` (a dict, or a JSON file path); an argument given both
ways must have the same value there (as in DeepSpeed: a conflict is an error).
Old and alternative DeepSpeed names are accepted: ``mp_size`` (= tensor_parallel.tp_size),
``kernel_inject`` (= replace_with_kernel_inject), ``injection_dict`` (= injection_policy),
``max_tokens`` (= max_out_tokens). DeepSpeed arguments tachyon does not implement are refused by
name; unknown names get a "did you mean". Defaults follow DeepSpeed (dtype float16), except that
kernel injection is on unless an ``injection_policy`` asks for tensor slicing alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from tachyon.config.errors import ConfigError, render, unknown_key

DTYPES: dict[Any, torch.dtype] = {
    torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16, torch.int8: torch.int8,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16, "int8": torch.int8,
    # DeepSpeed's DtypeEnum also takes the dtypes' printed names (a JSON config's "torch.float16")
    "torch.float32": torch.float32, "torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16,
    "torch.int8": torch.int8,
}
ALLOWED_DTYPES = "torch.float32, torch.float16, torch.bfloat16, torch.int8 (or 'fp32', 'fp16', 'bf16', 'int8')"

ALIASES = {"mp_size": "tensor_parallel.tp_size", "kernel_inject": "replace_with_kernel_inject",
           "injection_dict": "injection_policy", "max_tokens": "max_out_tokens"}
KEYS = ("dtype", "tensor_parallel", "replace_with_kernel_inject", "injection_policy", "checkpoint", "base_dir",
        "save_mp_checkpoint_path", "max_out_tokens", "enable_cuda_graph", "quant", "return_tuple", "min_out_tokens")
# accepted for DeepSpeed compatibility, with no effect here (and why)
IGNORED = {
    "return_tuple": "the engine returns what the model returns; injected layers are internal",
    "min_out_tokens": "a DeepSpeed warning threshold; the KV cache is sized per generate call",
    "use_triton": "Triton is tachyon's kernel language on every GPU path",
    "triton_autotune": "Triton kernels autotune on first use",
    "transposed_mode": "weights are kept as [out, in]",
    "training_mp_size": "checkpoints are resharded from full tensors or loaded as saved per rank",
}
REFUSED = {
    "mpu": "pass tensor_parallel={'tp_size': N, 'tp_group': group} instead",
    "moe": "mixture-of-experts inference is not implemented",
    "ep_size": "expert parallelism is not implemented",
    "moe_experts": "mixture-of-experts inference is not implemented",
    "moe_type": "mixture-of-experts inference is not implemented",
    "zero": "ZeRO-Inference is not implemented",
    "keep_module_on_host": "the model is moved to the local GPU when one exists",
    "replace_method": "injection is chosen from the model class; pass injection_policy for tensor slicing alone",
    "triangular_masking": "decoder models are always causal, encoders never",
    "set_empty_params": "load from checkpoint= instead",
    "checkpoint_config": "give the checkpoint's description in checkpoint=",
}
TP_KEYS = ("enabled", "tp_size", "tp_group", "tp_grain_size")
QUANT_KEYS = ("enabled", "weight", "activation", "qkv")
WEIGHT_QUANT_KEYS = ("enabled", "num_bits", "q_type", "q_groups", "group_size", "quantized_initialization",
                     "post_init_quant")


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """Weight-only INT8: ``group_size`` columns per scale, or DeepSpeed's ``q_groups`` flat groups;
    neither = one scale per output channel."""

    num_bits: int = 8
    group_size: int | None = None
    q_groups: int | None = None


@dataclasses.dataclass(frozen=True)
class InferenceConfig:
    dtype: torch.dtype = torch.float16
    tp_size: int = 1
    tp_group: Any = None
    replace_with_kernel_inject: bool = True
    injection_policy: dict | None = None
    checkpoint: Any = None
    base_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    max_out_tokens: int = 1024
    enable_cuda_graph: bool = False
    quant: WeightQuant | None = None
    ignored: tuple[str, ...] = ()

    @property
    def int8(self) -> bool:
        return self.quant is not None


def _load_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ConfigError(f"init_inference: config must be a dict or a JSON file path; got {render(config)}")
    return dict(config)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values whose == does not give a bool (tensors): the same object only
        return a is b


def _bool(problems: list[str], key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        problems.append(f"`{key}` must be true or false; got {render(value)}")
        return False
    return value


def _int(problems: list[str], key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"`{key}` must be an int >= {minimum}; got {render(value)}")
        return minimum
    return value


def _check_keys(problems: list[str], given: dict, allowed: tuple[str, ...], prefix: str) -> None:
    for key in given:
        if key not in allowed:
            path = f"{prefix}.{key}" if prefix else key
            problems.append(unknown_key(path, prefix, allowed))


def _tensor_parallel(problems: list[str], value: Any) -> tuple[int, Any]:
    if value is None:
        return 1, None
    if not isinstance(value, dict):
        problems.append(f"`tensor_parallel` must be a dict like {{'tp_size': 2}}; got {render(value)}")
        return 1, None
    _check_keys(problems, value, TP_KEYS, "tensor_parallel")
    size = _int(problems, "tensor_parallel.tp_size", value.get("tp_size", 1), 1)
    if value.get("enabled", True) is False:
        size = 1
    grain = value.get("tp_grain_size", 1)
    if grain not in (1, 64):
        problems.append(f"`tensor_parallel.tp_grain_size` is not used (slices are whole heads); got {render(grain)}")
    return size, value.get("tp_group")


def _quant(problems: list[str], value: Any, dtype: torch.dtype) -> WeightQuant | None:
    if value is None or value == {}:
        return WeightQuant() if dtype == torch.int8 else None
    if not isinstance(value, dict):
        problems.append(f"`quant` must be a dict like {{'enabled': true, 'weight': {{'num_bits': 8}}}}; got {render(value)}")
        return None
    _check_keys(problems, value, QUANT_KEYS, "quant")
    activation = value.get("activation") or {}
    if isinstance(activation, dict) and activation.get("enabled", False):
        problems.append("`quant.activation.enabled: true`: activation quantization is not implemented (INT8 here is "
                        "weight-only: int8 weights, fp16/bf16/fp32 activations); remove it")
    enabled = bool(value.get("enabled", True)) or dtype == torch.int8
    weight = value.get("weight") or {}
    if not isinstance(weight, dict):
        problems.append(f"`quant.weight` must be a dict; got {render(weight)}")
        return None
    _check_keys(problems, weight, WEIGHT_QUANT_KEYS, "quant.weight")
    if not weight.get("enabled", True) or not enabled:
        return WeightQuant() if dtype == torch.int8 else None
    bits = weight.get("num_bits", 8)
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        problems.append(f"`quant.weight.num_bits` must be an int in [2, 8] (the grid the weights are snapped to; "
                        f"stored as int8, e.g. a MoQ model's target_bits); got {render(bits)}")
        bits = 8
    if weight.get("q_type", "symmetric") != "symmetric":
        problems.append(f"`quant.weight.q_type` must be \"symmetric\"; got {render(weight.get('q_type'))}")
    group_size, q_groups = weight.get("group_size"), weight.get("q_groups")
    if q_groups == 1 and group_size is None:
        q_groups = None  # DeepSpeed's default; per-channel scales are finer and always exact
    if group_size is not None:
        group_size = _int(problems, "quant.weight.group_size", group_size, 1)
    if q_groups is not None:
        q_groups = _int(problems, "quant.weight.q_groups", q_groups, 1)
    if group_size is not None and q_groups is not None:
        problems.append("`quant.weight`: give group_size (columns per scale) or q_groups (DeepSpeed's flat groups), not both")
    return WeightQuant(bits, group_size, q_groups)


def build_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """An InferenceConfig from ``config`` (dict / JSON path) and keyword arguments; every problem
    found is reported at once (ConfigError, a ValueError)."""
    merged = _load_dict(config)
    problems: list[str] = []
    for key in sorted(set(merged) & set(kwargs)):
        if not _same(merged[key], kwargs[key]):
            problems.append(f"`{key}` is given in config= ({render(merged[key])}) and as an argument "
                            f"({render(kwargs[key])}) with different values; give it once")
    merged.update(kwargs)
    ignored = []
    for old, new in ALIASES.items():
        if old in merged:
            value = merged.pop(old)
            if new == "tensor_parallel.tp_size":
                tp = dict(merged.get("tensor_parallel") or {})
                if "tp_size" in tp and tp["tp_size"] != value:
                    problems.append(f"`mp_size` ({value}) and `tensor_parallel.tp_size` ({tp['tp_size']}) disagree; give one")
                tp.setdefault("tp_size", value)
                merged["tensor_parallel"] = tp
            elif new in merged and merged[new] != value:
                problems.append(f"`{old}` and `{new}` name the same setting with different values; give one")
            else:
                merged[new] = value
    for key in list(merged):
        if key in REFUSED:
            value = merged[key]
            off = value is None or value is False or value == {} or (key == "ep_size" and value == 1)
            if not off:
                problems.append(f"`{key}` is a DeepSpeed-Inference argument tachyon does not support ({REFUSED[key]})")
            merged.pop(key)
        elif key in IGNORED:
            ignored.append(key)
            merged.pop(key)
    _check_keys(problems, merged, KEYS + tuple(ALIASES), "")
    dtype = merged.get("dtype", torch.float16)
    try:
        dtype = DTYPES[dtype]
    except (KeyError, TypeError):
        problems.append(f"`dtype` {render(dtype) if not isinstance(dtype, torch.dtype) else dtype} is not supported; "
                        f"allowed: {ALLOWED_DTYPES}")
        dtype = torch.float16
    tp_size, tp_group = _tensor_parallel(problems, merged.get("tensor_parallel"))
    policy = merged.get("injection_policy")
    inject = merged.get("replace_with_kernel_inject")
    if inject is None:
        inject = policy is None
    inject = _bool(problems, "replace_with_kernel_inject", inject)
    if inject and policy is not None:
        problems.append("`injection_policy` asks for tensor slicing alone (the model's own layers, sliced); it "
                        "cannot be combined with replace_with_kernel_inject=True")
    if policy is not None and (not isinstance(policy, dict) or not policy):
        problems.append(f"`injection_policy` must be a dict {{LayerClass: ('attn.out_proj', 'mlp.down_proj')}}; "
                        f"got {render(policy)}")
    max_out = _int(problems, "max_out_tokens", merged.get("max_out_tokens", 1024), 1)
    cuda_graph = _bool(problems, "enable_cuda_graph", merged.get("enable_cuda_graph", False))
    quant = _quant(problems, merged.get("quant"), dtype)
    if quant is not None and not inject:
        problems.append("INT8 weights (dtype=torch.int8 or quant.enabled) need kernel injection "
                        "(replace_with_kernel_inject=True): the int8 GEMM runs inside tachyon's injected layers")
    for key in ("base_dir", "save_mp_checkpoint_path"):
        if merged.get(key) is not None and not isinstance(merged[key], (str, os.PathLike)):
            problems.append(f"`{key}` must be a path; got {render(merged[key])}")
    if problems:
        raise ConfigError(problems)
    return InferenceConfig(
        dtype=dtype, tp_size=tp_size, tp_group=tp_group, replace_with_kernel_inject=inject, injection_policy=policy,
        checkpoint=merged.get("checkpoint"), base_dir=merged.get("base_dir"),
        save_mp_checkpoint_path=merged.get("save_mp_checkpoint_path"), max_out_tokens=max_out,
        enable_cuda_graph=cuda_graph, quant=quant, ignored=tuple(ignored),
    )


__all__ = ["ALLOWED_DTYPES", "InferenceConfig", "WeightQuant", "build_config"]
