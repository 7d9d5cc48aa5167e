"""PyTorch reference for the fused bias + activation: the CPU path and the oracle for Triton.

For x: [..., K] and an optional bias: [K], in fp32 whatever the input dtype:

    h = x + bias                                   (the pre-activation)
    y = act(h)                                     K = F: gelu, gelu_tanh, relu, silu, qgelu
    a, b = h.chunk(2, -1); y = act(a) * b          K = 2F: swiglu (act = silu), geglu (act = gelu),
                                                   geglu_tanh (act = gelu_tanh: Transformer Engine's geglu)

y is returned in x's dtype with last dim F. (fp64 inputs are computed in fp64: the tests' oracle.) The gated halves are split AFTER the bias is added,
and the first half is the gate that goes through the activation (Transformer Engine's convention).

The activations, with their derivatives (used by the explicit backward and the Triton kernel):

    gelu       h * Phi(h),  Phi = 0.5 (1 + erf(h / sqrt 2))      d = Phi + h * exp(-h^2/2) / sqrt(2 pi)
    gelu_tanh  0.5 h (1 + t), t = tanh(c (h + 0.044715 h^3)), c = sqrt(2/pi)
               d = 0.5 (1 + t) + 0.5 h (1 - t^2) c (1 + 3 * 0.044715 h^2)
    relu       max(h, 0)                                          d = [h > 0]
    silu       h * s, s = sigmoid(h)                              d = s (1 + h (1 - s))
    qgelu      h * s, s = sigmoid(1.702 h)                        d = s (1 + 1.702 h (1 - s))

:func:`bias_act` and :func:`bias_act_linear` are plain autograd code (the test oracle);
:func:`bias_act_forward` / :func:`bias_act_backward` are the explicit forward and backward the
op's CPU path runs, the same math as the Triton kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "qgelu", "swiglu", "geglu", "geglu_tanh")
# gated name -> the activation applied to the gate half
GATED = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def is_gated(activation: str) -> bool:
    return activation in GATED


def _act(h: torch.Tensor, name: str) -> torch.Tensor:
    """The activation on fp32 h, written with torch's own functions (autograd-able)."""
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    if name == "silu":
        return F.silu(h)
    if name == "qgelu":
        return h * torch.sigmoid(1.702 * h)
    raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(map(repr, ACTIVATIONS))}")


def _act_and_grad(h: torch.Tensor, name: str, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(act(h), act'(h)) on fp32 h, from the closed forms in the module docstring; act'(h) is None
    when not ``grad`` (the forward pass: only act(h) is computed)."""
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
        return h * cdf, (cdf + h * torch.exp(-0.5 * h * h) * _INV_SQRT_2PI if grad else None)
    if name == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (h + 0.044715 * h * h * h))
        if not grad:
            return 0.5 * h * (1.0 + t), None
        d = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * h * h)
        return 0.5 * h * (1.0 + t), d
    if name == "relu":
        return torch.clamp_min(h, 0.0), ((h > 0).to(h.dtype) if grad else None)
    if name in ("silu", "qgelu"):
        k = 1.0 if name == "silu" else 1.702
        s = torch.sigmoid(k * h)
        return h * s, (s * (1.0 + k * h * (1.0 - s)) if grad else None)
    raise ValueError(f"unknown activation {name!r}; allowed: {', '.join(map(repr, ACTIVATIONS))}")


def _pre_activation(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + bias in fp32 (in fp64 for fp64 inputs: the tests' oracle)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dtype)
    return h + bias.to(dtype) if bias is not None else h


def bias_act(x: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "gelu") -> torch.Tensor:
    """Autograd reference. x: [..., K], bias: [K] or None -> y: [..., F] in x's dtype (F = K, or K/2 gated)."""
    h = _pre_activation(x, bias)
    if is_gated(activation):
        a, b = h.chunk(2, dim=-1)
        return (_act(a, GATED[activation]) * b).to(x.dtype)
    return _act(h, activation).to(x.dtype)


def bias_act_linear(
    x: torch.Tensor, bias: torch.Tensor | None, activation: str, weight2: torch.Tensor, bias2: torch.Tensor | None,
) -> torch.Tensor:
    """Autograd reference of ``linear(bias_act(x, bias, activation), weight2, bias2)``.

    weight2: [O, F], bias2: [O] or None -> [..., O] in x's dtype.
    """
    return F.linear(bias_act(x, bias, activation), weight2, bias2)


def bias_act_forward(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """Explicit forward (no graph kept): the op's CPU path. Same shapes as :func:`bias_act`."""
    with torch.no_grad():
        h = _pre_activation(x, bias)
        if is_gated(activation):
            a, b = h.chunk(2, dim=-1)
            y, _ = _act_and_grad(a, GATED[activation], grad=False)
            return (y * b).to(x.dtype)
        y, _ = _act_and_grad(h, activation, grad=False)
        return y.to(x.dtype)


def bias_act_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, activation: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Explicit backward from the pre-activation (x and bias; y is not needed).

    dy: [M, F], x: [M, K]. Returns (dx [M, K] in x's dtype, dbias [K] in bias's dtype or None);
    dbias is the row sum of the fp32 gradient of the pre-activation.
    """
    with torch.no_grad():
        h = _pre_activation(x, bias)
        g = dy.float()
        if is_gated(activation):
            a, b = h.chunk(2, dim=-1)
            act_a, dact_a = _act_and_grad(a, GATED[activation])
            dh = torch.cat([g * b * dact_a, g * act_a], dim=-1)
        else:
            _, dact = _act_and_grad(h, activation)
            dh = g * dact
        dbias = dh.sum(dim=tuple(range(dh.dim() - 1))).to(bias.dtype) if bias is not None else None
        return dh.to(x.dtype), dbias
