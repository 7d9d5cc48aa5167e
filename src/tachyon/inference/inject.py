"""init_inference: validate, pick the policy, load and slice the weights, build the engine.

Order (every check that can fail does so before a weight is copied): config -> tensor-parallel
group -> policy from the model class and its exactness checks (sizes divisible by tp_size
included) -> checkpoint -> extract, slice for this rank, quantize, build on the device -> engine.
The device is the local GPU (cuda:LOCAL_RANK) when there is one, else the CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tachyon.inference.config import InferenceConfig, build_config
from tachyon.inference.decoder import InjectedDecoder
from tachyon.inference.engine import InferenceEngine
from tachyon.inference.layers import EncoderLayer
from tachyon.inference.policies import policy_for
from tachyon.inference.tensor_parallel import slice_layers, tp_group
from tachyon.inference.weights import check_divisible, shard_decoder, shard_encoder


def target_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def compute_dtype(config: InferenceConfig, device: torch.device) -> torch.dtype:
    """The activation dtype: the given float dtype, or for dtype=torch.int8 fp16 on a GPU (DeepSpeed's
    INT8 mode: int8 weights, fp16 activations) and fp32 on the CPU (CPU fp16 matmuls are slow)."""
    if config.dtype != torch.int8:
        return config.dtype
    return torch.float16 if device.type == "cuda" else torch.float32


def _record_hidden_states(layer: nn.Module) -> None:
    """transformers >= 5 collects output_hidden_states with hooks on its own layer classes; give
    the injected encoder layer the same hook."""
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:
        return
    install_output_capuring_hook(layer, "hidden_states", 0)


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed-Inference's ``init_inference`` (see tachyon.inference and docs/inference.md)."""
    cfg = build_config(config, **kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"init_inference: model must be a torch.nn.Module (an HF model); got {type(model).__name__}")
    from tachyon.inference.checkpoint import load_checkpoint, save_tp_checkpoint

    if cfg.enable_cuda_graph and not torch.cuda.is_available():
        raise ValueError("enable_cuda_graph=True needs a CUDA device (it captures the decode step in a CUDA graph); "
                         "this machine has none: leave enable_cuda_graph off")

    if cfg.replace_with_kernel_inject:
        policy = policy_for(model)
        policy.check(cfg.tp_size)
        heads, kv_heads, _ = policy.heads()
        check_divisible(cfg.tp_size, heads=heads, kv_heads=kv_heads, intermediate_size=policy.ffn_size())
    elif cfg.tp_size > 1 and cfg.injection_policy is None:
        raise ValueError("tensor_parallel.tp_size > 1 needs kernel injection (replace_with_kernel_inject=True) or an "
                         "injection_policy naming the row-parallel linears; automatic tensor slicing of arbitrary "
                         "models is not implemented")
    group, rank = tp_group(cfg.tp_size, cfg.tp_group)
    device = target_device()
    dtype = compute_dtype(cfg, device)
    sharded = load_checkpoint(model, cfg, rank)  # a pre-sharded checkpoint is loaded after the build
    model.eval()
    if not cfg.replace_with_kernel_inject:
        model.to(dtype=dtype)
        if cfg.injection_policy is not None and cfg.tp_size > 1:
            slice_layers(model, cfg.injection_policy, rank, cfg.tp_size, group)
        model.to(device=device)
        engine = InferenceEngine(model, cfg, kind="hf", hf_model=model, tp_group=group)
    elif policy.kind == "decoder":
        weights = shard_decoder(policy.extract(), rank, cfg.tp_size)
        module = InjectedDecoder(weights, group=group, dtype=dtype, device=device, quant=cfg.quant)
        engine = InferenceEngine(module, cfg, kind="decoder", hf_model=model, tp_group=group, policy=policy.name)
    else:
        layer_weights = {id(layers): shard_encoder([policy.extract_layer(layer) for layer in layers], rank, cfg.tp_size)
                         for layers in policy.layer_lists()}
        lists = policy.layer_lists()
        model.to(device=device, dtype=dtype)  # before the injected layers go in: their int8 scales stay fp32
        for layers in lists:
            for index, w in enumerate(layer_weights[id(layers)]):
                layers[index] = EncoderLayer(w, group=group, dtype=dtype, device=device, quant=cfg.quant)
                _record_hidden_states(layers[index])
        engine = InferenceEngine(model, cfg, kind="encoder", hf_model=model, tp_group=group, policy=policy.name)
    if sharded is not None:
        sharded(engine)
    if cfg.save_mp_checkpoint_path is not None:
        save_tp_checkpoint(engine, cfg.save_mp_checkpoint_path, rank)
    return engine


__all__ = ["compute_dtype", "init_inference", "target_device"]
