"""Tensor-parallel process groups for inference, and tensor slicing of the HF model's own layers.

Groups: ``tensor_parallel={"tp_size": N}`` splits the world into blocks of N consecutive ranks
(ranks 0..N-1 form group 0, ...), DeepSpeed's layout; ``{"tp_group": group}`` uses a group the
caller made. torch.distributed must be initialized (``tachyon.init_distributed()`` or torchrun).

Slicing alone (``injection_policy={LayerClass: ("attn.out_proj", "mlp.down_proj")}``, DeepSpeed's
form): inside every instance of LayerClass, the named linears are row-parallel (their input
columns split, output all-reduced, bias added once after) and every other nn.Linear is
column-parallel (output rows split: q, k, v, gate, up, fc_in). Attributes HF attention modules
use to reshape (num_heads, num_key_value_heads, all_head_size, ...) are divided by tp_size. The
layer's own forward then runs unchanged on its slice. Written by hand because the slices must
follow HF's head layout and DTensor's parallelize_module would need a plan per architecture
(and would turn the HF layers' reshapes into DTensor ops); an all-reduce hook per row-parallel
linear is all the communication this needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tachyon.inference.weights import check_divisible

# attributes of HF attention / MLP modules that count heads or slice widths, divided by tp_size
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "all_head_size",
                   "split_size", "num_kv_heads")
# names of fused q | k | v projections (equal thirds)
FUSED_QKV = ("c_attn", "qkv_proj", "query_key_value", "Wqkv", "W_pack")


def tp_group(tp_size: int, group: Any = None) -> tuple[Any, int]:
    """(process group or None for tp_size 1, this rank's index in it)."""
    if tp_size == 1:
        return None, 0
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"tensor_parallel.tp_size={tp_size} needs torch.distributed initialized: call "
                         "tachyon.init_distributed() first, or start with torchrun --nproc-per-node "
                         f"{tp_size} (or tachyon launch)")
    if group is not None:
        if dist.get_world_size(group) != tp_size:
            raise ValueError(f"tensor_parallel.tp_group has {dist.get_world_size(group)} ranks but tp_size={tp_size}")
        return group, dist.get_rank(group)
    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tensor_parallel.tp_size={tp_size} must divide the world size {world}")
    if world == tp_size:
        return dist.group.WORLD, dist.get_rank()
    from tachyon.parallel.distributed import new_group

    mine = None
    for start in range(0, world, tp_size):  # every rank creates every group, in the same order
        g = new_group(list(range(start, start + tp_size)))
        if start <= dist.get_rank() < start + tp_size:
            mine = g
    return mine, dist.get_rank(mine)


def _all_reduce_hook(group: Any, bias: torch.Tensor | None):
    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output if bias is None else output + bias
    return hook


def _slice_linear(module: nn.Module, rank: int, tp: int, row_parallel: bool, group: Any, name: str) -> None:
    conv1d = type(module).__name__ == "Conv1D"  # HF's Conv1D: weight [in, out]
    if not isinstance(module, nn.Linear) and not conv1d:
        raise ValueError(f"injection_policy names {name!r}, a {type(module).__name__}; tensor slicing handles "
                         "nn.Linear and HF Conv1D layers")
    w = module.weight.data
    out_dim, in_dim = (1, 0) if conv1d else (0, 1)
    size = w.shape[in_dim if row_parallel else out_dim]
    if size % tp:
        raise ValueError(f"{name}: {'input' if row_parallel else 'output'} size {size} is not divisible by tp_size={tp}")
    with torch.no_grad():
        if row_parallel:
            module.weight = nn.Parameter(w.chunk(tp, dim=in_dim)[rank].contiguous(), requires_grad=False)
            bias = module.bias
            if bias is not None:  # added once, after the all-reduce (Conv1D's addmm needs a bias: zeros)
                module.bias = nn.Parameter(torch.zeros_like(bias), requires_grad=False) if conv1d else None
            module.register_forward_hook(_all_reduce_hook(group, None if bias is None else bias.detach()))
        else:
            # a fused q | k | v projection is sliced part by part, so each rank keeps its heads of all three
            parts = 3 if name.rsplit(".", 1)[-1] in FUSED_QKV else 1

            def cut(t: torch.Tensor, dim: int) -> torch.Tensor:
                return torch.cat([p.chunk(tp, dim=dim)[rank] for p in t.chunk(parts, dim=dim)], dim=dim).contiguous()

            module.weight = nn.Parameter(cut(w, out_dim), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(cut(module.bias.data, 0), requires_grad=False)
    if isinstance(module, nn.Linear):
        module.in_features, module.out_features = module.weight.shape[1], module.weight.shape[0]
    else:
        module.nf = module.weight.shape[1]


def slice_layers(model: nn.Module, policy: dict, rank: int, tp: int, group: Any) -> int:
    """Apply ``injection_policy`` to ``model`` in place; returns how many layers were sliced."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is not None:
        check_divisible(tp, heads=heads, kv_heads=kv_heads)
    sliced = 0
    for layer_class, row_names in policy.items():
        if not isinstance(layer_class, type) or not isinstance(row_names, (tuple, list)) or not all(
                isinstance(n, str) for n in row_names):
            raise ValueError("injection_policy must map layer classes to tuples of linear names, e.g. "
                             "{LlamaDecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}; got "
                             f"{layer_class!r}: {row_names!r}")
        layers = [m for m in model.modules() if isinstance(m, layer_class)]
        if not layers:
            raise ValueError(f"injection_policy: {type(model).__name__} has no {layer_class.__name__}")
        for layer in layers:
            names = dict(layer.named_modules())
            missing = [n for n in row_names if n not in names]
            if missing:
                raise ValueError(f"injection_policy: {layer_class.__name__} has no submodule {missing}; its linears: "
                                 f"{[n for n, m in names.items() if isinstance(m, nn.Linear)]}")
            for name, module in names.items():
                if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
                    _slice_linear(module, rank, tp, name in row_names, group, f"{layer_class.__name__}.{name}")
                for attr in HEAD_ATTRIBUTES:
                    value = getattr(module, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                        setattr(module, attr, value // tp)
            sliced += 1
    return sliced


__all__ = ["HEAD_ATTRIBUTES", "slice_layers", "tp_group"]
