"""What every injection policy shares: class matching, refusal messages, weight helpers.

A policy converts one family of HF models exactly or not at all: ``check`` runs before any weight
is read (sizes, settings the injected layers do not implement, custom layer classes) and raises a
ValueError naming the setting, its value and what is supported; ``extract`` then reads the
weights into :mod:`tachyon.inference.weights` containers without changing the HF model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tachyon.inference.weights import Norm

# HF activation names -> tachyon.kernels.activation names (same function, same formula)
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                  "relu": "relu", "silu": "silu", "swish": "silu", "quick_gelu": "qgelu"}


class Policy:
    """Base of the injection policies. ``model_classes``: HF class names this policy converts;
    ``layer_classes``: the HF layer classes it knows how to read (anything else is refused)."""

    name = "base"
    kind = "decoder"  # or "encoder"
    model_classes: tuple[str, ...] = ()
    layer_classes: tuple[str, ...] = ()

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return type(model).__name__ in cls.model_classes

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config

    def refuse(self, setting: str, value: Any, supported: str) -> None:
        raise ValueError(f"{type(self.model).__name__}: {setting}={value!r} cannot be converted exactly by tachyon's "
                         f"{self.name} injection policy; supported: {supported}")

    def check_layers(self, layers: nn.ModuleList) -> None:
        for index, layer in enumerate(layers):
            if type(layer).__name__ not in self.layer_classes:
                raise ValueError(f"{type(self.model).__name__}: layer {index} is a {type(layer).__name__}, not one of "
                                 f"{', '.join(self.layer_classes)}; a custom or patched layer cannot be injected "
                                 "exactly (use injection_policy={LayerClass: (...)} for tensor slicing alone)")

    def activation(self, name: Any, gated: bool = False) -> str:
        if not isinstance(name, str) or name not in HF_ACTIVATIONS:
            self.refuse("activation", name, ", ".join(HF_ACTIVATIONS))
        act = HF_ACTIVATIONS[name]
        if gated:
            if act != "silu":
                self.refuse("hidden_act (gated MLP)", name, "'silu' (SwiGLU)")
            return "swiglu"
        return act

    def heads(self) -> tuple[int, int, int]:
        """(heads, kv_heads, head_dim)."""
        raise NotImplementedError

    def ffn_size(self) -> int:
        raise NotImplementedError

    def check(self, tp_size: int) -> None:
        raise NotImplementedError


def layer_norm(module: nn.Module) -> Norm:
    if not isinstance(module, nn.LayerNorm) or not module.elementwise_affine:
        raise ValueError(f"expected an affine nn.LayerNorm; got {type(module).__name__}")
    return Norm(module.weight.detach(), None if module.bias is None else module.bias.detach(), module.eps, "layer")


def rms_norm(module: nn.Module) -> Norm:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None or getattr(module, "weight", None) is None:
        raise ValueError(f"expected an RMSNorm with a weight and variance_epsilon; got {type(module).__name__}")
    return Norm(module.weight.detach(), None, float(eps), "rms")


def linear(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight [out, in], bias or None) of an nn.Linear or an HF Conv1D (whose weight is [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), None if module.bias is None else module.bias.detach()
    if type(module).__name__ == "Conv1D":
        return module.weight.detach().t(), module.bias.detach()
    raise ValueError(f"expected nn.Linear or Conv1D; got {type(module).__name__}")


def rope_table(inv_freq: Tensor, positions: int, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """HF Llama's cos/sin for positions 0..positions-1, fp32 [positions, 2 * len(inv_freq)]:
    the same products position * inv_freq HF computes, laid out cat([f, f])."""
    freqs = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


__all__ = ["HF_ACTIVATIONS", "Policy", "layer_norm", "linear", "rms_norm", "rope_table"]
