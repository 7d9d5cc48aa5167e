"""PyTorch reference for the weight-only INT8 linear and the symmetric quantizer (MoQ's too).

Symmetric quantization of a weight W [N, K] (N output features) to b bits, group by group:

    qmax     = 2^(b-1) - 1                           (127 for int8)
    scale_g  = max|W_g| / qmax                       (fp32; a group of zeros gets scale 1)
    Q        = clamp(round(W / scale_g), -qmax, qmax)  stored as int8 for b <= 8
    W~       = Q * scale_g                           (dequantized; |W - W~| <= scale_g / 2)

Groups are laid out as scales [N, G]: row n, columns [g * K/G, (g+1) * K/G) share scales[n, g].
``group_size=None`` is per-channel (G = 1); ``group_size=s`` splits each row into K/s groups.
DeepSpeed's ``q_groups`` (the flattened weight cut into q_groups equal chunks, what MoQ and its
INT8 kernels use) maps onto the same layout: chunks of whole rows repeat one scale down those
rows, chunks inside a row are column groups; :func:`quantize_symmetric` takes either.

The linear: y = x @ W~^T + bias, accumulated in fp32, returned in x's dtype. The error against
the float weight is bounded per output by sum_k |x_k| * scale_{g(k)} / 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tachyon.kernels.activation.reference import bias_act_forward


def _check_bits(num_bits: int, most: int = 8) -> int:
    if isinstance(num_bits, bool) or not isinstance(num_bits, int) or not 2 <= num_bits <= most:
        stored = " (stored as int8)" if most == 8 else ""
        raise ValueError(f"num_bits must be an int in [2, {most}]{stored}; got {num_bits!r}")
    return (1 << (num_bits - 1)) - 1


def scale_group_size(n: int, k: int, group_size: int | None = None, q_groups: int | None = None) -> tuple[int, int]:
    """(rows per scale, columns per scale) for a [n, k] weight; see the module docstring."""
    if group_size is not None and q_groups is not None:
        raise ValueError("give group_size (columns per scale) or q_groups (DeepSpeed's flat groups), not both")
    if q_groups is not None:
        if isinstance(q_groups, bool) or not isinstance(q_groups, int) or q_groups < 1 or (n * k) % q_groups:
            raise ValueError(f"q_groups={q_groups!r} must be an int >= 1 dividing the weight's {n * k} elements")
        chunk = n * k // q_groups
        if chunk % k == 0:
            return chunk // k, k
        if k % chunk == 0:
            return 1, chunk
        raise ValueError(f"q_groups={q_groups} cuts a [{n}, {k}] weight into chunks of {chunk} elements, which are "
                         f"neither whole rows nor an even split of a row of {k}; allowed: q_groups dividing {n} or "
                         f"a multiple of {n} whose row chunks divide {k}")
    if group_size is None:
        return 1, k
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size!r} must be an int >= 1 dividing in_features={k}")
    return 1, group_size


def _grid(weight: torch.Tensor, num_bits: int, group_size: int | None, q_groups: int | None, most: int):
    """(Q as fp32 [N, K], scales fp32 [N, G]) on the symmetric num_bits grid."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = f"{tuple(weight.shape)} {weight.dtype}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"quantize: weight must be a 2-d float tensor [out_features, in_features]; got {got}")
    qmax = _check_bits(num_bits, most)
    n, k = weight.shape
    rows, cols = scale_group_size(n, k, group_size, q_groups)
    blocks = weight.detach().float().reshape(n // rows, rows, k // cols, cols)
    absmax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    q = torch.clamp(torch.round(blocks / scale), -qmax, qmax).reshape(n, k)
    return q, scale.expand(n // rows, rows, k // cols, 1).reshape(n, k // cols).contiguous()


def quantize_symmetric(
    weight: torch.Tensor, num_bits: int = 8, *, group_size: int | None = None, q_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (Q int8 [N, K], scales fp32 [N, K / columns per scale]); num_bits <= 8."""
    q, scales = _grid(weight, num_bits, group_size, q_groups, 8)
    return q.to(torch.int8).contiguous(), scales


def dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Q int8 [N, K], scales [N, G] -> W~ fp32 [N, K]."""
    n, k = qweight.shape
    g = scales.shape[1]
    return (qweight.float().view(n, g, k // g) * scales.float()[:, :, None]).view(n, k)


def fake_quantize(weight: torch.Tensor, num_bits: int = 8, *, group_size: int | None = None,
                  q_groups: int | None = None) -> torch.Tensor:
    """W~ in weight's dtype: the weight snapped onto its num_bits grid (MoQ's training-time step;
    up to 16 bits). For num_bits <= 8 it equals dequantize(*quantize_symmetric(...)) exactly."""
    q, scales = _grid(weight, num_bits, group_size, q_groups, 16)
    n, k = q.shape
    g = scales.shape[1]
    return (q.view(n, g, k // g) * scales[:, :, None]).view(n, k).to(weight.dtype)


def int8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
    activation: str | None = None, backend: str | None = None,
) -> torch.Tensor:
    """y = act(x @ dequantize(Q, scales)^T + bias) in fp32 (fp64 for fp64 x), returned in x's dtype.
    x [..., K], qweight int8 [R, K], scales [R, G], bias [R] or None -> [..., R], or [..., R / 2]
    for a gated ``activation`` (kernels/activation's names and math: the bias is added, then the
    activation, with no rounding in between). ``backend`` is ignored."""
    del backend
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize(qweight, scales).to(acc)
    h = F.linear(x.to(acc), w, bias.to(acc) if bias is not None else None)
    if activation is not None:
        h = bias_act_forward(h, None, activation)
    return h.to(x.dtype)
